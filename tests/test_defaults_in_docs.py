"""What the docs and lessons say an option defaults to is what the code does.

The code is read, never copied: the defaults come from an `Engine` built with `EngineConfig()`
(what the engine decides for the fields left unset, such as prefix caching, is read off the
scheduler it built) and from the argparse options of `nanoserve` and its subcommands
(`nanoserve.cli.build_parser`, `bench` included). When a default changes in the code, every
page that still states the old one fails here.

The statements are found automatically, in README.md, weeks/README.md, weeks/*/README.md and
docs/*.md (but not docs/benchmarks.md, a dated record: "chunked prefill stays off by default"
was true on the day it was measured):

1. The text is cut into sentences (a table row, a list item and a comment line of a shell block
   count as one; Python blocks are quotes of the code, checked by tests/test_lessons.py).
2. A sentence states a default when it holds one of the phrases of `SWITCH_PHRASES` ("on by
   default", "Off by default", "default: off") or `VALUE_PHRASES` ("(default 256)", "default:
   fcfs", "defaults to 1", "300 by default").
3. Its subject is an option named by its flag (`--enable-prefix-caching`, `--no-metrics`), by its
   field name in backticks (`max_num_seqs`), or by a name in prose from `PROSE` ("prefix
   caching", "speculative decoding"): the one named last before the phrase in its clause, else in
   its sentence ("both default to 1": the last two). A sentence that starts with the phrase ("Off
   by default: `--speculative ngram` turns it on") takes the option named after it; one that
   names no option at all takes the subject of the sentences before it in its paragraph, then of
   its section's heading ("Off by default; ..." under "## Week 17: speculative decoding"), then
   of its page's title.
4. A statement about a case ("on the CPU", "with CUDA graphs", "in your workspace", "once week 14
   is done") is not about the default everyone gets, and is left out (`QUALIFIERS`), as are the
   options whose default depends on the machine or the model (`DEPENDS_ON_CONTEXT`) and the
   subcommand options whose default differs between subcommands (`--port`, `--max-tokens`).

`test_statements_are_found` pins a few known statements, so that a change to the patterns that
stops finding them fails; `test_a_wrong_default_is_caught` plants wrong ones in a temporary page.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanoserve.testing import command_parsers

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "weeks" / "README.md"]
    found += sorted((ROOT / "weeks").glob("*/README.md"))
    found += sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")
    return [p for p in found if p.is_file()]


# ------------------------------------------------------------------------------ the code

# Fields whose default is decided by the machine or the model ("bfloat16 on CUDA", "the model's
# context length"): a page states them per case, and this CPU sees only one of the cases.
DEPENDS_ON_CONTEXT = {
    "model", "dtype", "device", "attention_backend", "num_blocks", "kv_cache_memory", "max_model_len",
    "cuda_graphs", "fused_kernels", "async_scheduling", "trace", "draft_model",
}
# Fields the engine resolves when it is built (None in EngineConfig): where to read what it decided.
RESOLVED_BY_THE_ENGINE = {
    "enable_prefix_caching": lambda engine: engine.scheduler.prefix_caching,
    "enable_chunked_prefill": lambda engine: engine.scheduler.chunked_prefill,
    "max_num_batched_tokens": lambda engine: engine.scheduler.max_num_batched_tokens,
}
# Options that pages describe as a feature being on or off, and what "off" means for those that
# are not booleans.
OFF_VALUE = {"speculative": None, "scheduling_policy": "fcfs"}
# How pages name some options in prose (besides the flags and the field names, found in the code).
PROSE = {
    "enable_prefix_caching": ["prefix caching"],
    "enable_chunked_prefill": ["chunked prefill", "chunking"],
    "speculative": ["speculative decoding", "speculation"],
    "metrics": ["/metrics", "metrics"],
    "scheduling_policy": ["priority scheduling", "priorities"],
    "log_requests": ["request log"],
    "preemption": ["preemption"],
}


@dataclass
class Option:
    key: str  # the EngineConfig field or the argparse dest
    default: object  # the code's effective default
    flags: list[str]  # --long-flags, as typed
    checked: bool = True  # False: a default that depends on the machine, the model or the subcommand; a
    # statement about it is recognised (so that it is not taken for one about another option) and not checked

    @property
    def is_switch(self) -> bool:
        return isinstance(self.default, bool) or self.key in OFF_VALUE

    def switched_on(self) -> bool:
        if isinstance(self.default, bool):
            return self.default
        return self.default != OFF_VALUE[self.key]


def cli_options() -> dict[str, tuple[set, list[str]]]:
    """dest -> (the defaults it has in the subcommands that take it, its long flags)."""
    from nanoserve.cli import build_parser

    found: dict[str, tuple[set, list[str]]] = {}
    for _, parser in command_parsers(build_parser()):
        for action in parser._actions:
            flags = [s for s in action.option_strings if s.startswith("--")]
            if not flags or action.dest == "help":
                continue
            defaults, known = found.setdefault(action.dest, (set(), []))
            defaults.add(repr(action.default))
            known += [f for f in flags if f not in known]
    return found


def engine_defaults() -> dict[str, object]:
    """Each EngineConfig field -> what an engine built from `EngineConfig()` (on the CPU) uses."""
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine

    engine = Engine(EngineConfig(device="cpu", num_blocks=64))  # neither is an option checked here
    values = {f.name: getattr(engine.config, f.name) for f in dataclasses.fields(EngineConfig)}
    values.update({name: read(engine) for name, read in RESOLVED_BY_THE_ENGINE.items()})
    values.update(app_defaults(engine))
    return values


def app_defaults(engine) -> dict[str, object]:
    """Server options `create_app` resolves (None on the command line: "decide for me"): what an
    app built without them does."""
    from nanoserve.engine.async_engine import AsyncEngine
    from nanoserve.server.app import create_app

    app = create_app(AsyncEngine(engine), "tiny")
    return {"metrics": app.state.metrics is not None}


def code_options(engine: dict[str, object], cli: dict[str, tuple[set, list[str]]]) -> dict[str, Option]:
    options = {}
    for key, value in engine.items():
        options[key] = Option(key, value, cli.get(key, (set(), []))[1], checked=key not in DEPENDS_ON_CONTEXT)
    for dest, (defaults, flags) in cli.items():
        if dest in options:
            continue  # an engine field: what the engine makes of it wins
        try:
            default = ast.literal_eval(next(iter(defaults)))  # the repr of a plain value
        except ValueError:
            default = None
        options[dest] = Option(dest, default, flags, checked=len(defaults) == 1 and dest not in DEPENDS_ON_CONTEXT)
    return options


@pytest.fixture(scope="module")
def options() -> dict[str, Option]:
    if os.environ.get("NANOSERVE_WORKSPACE"):
        pytest.skip("the docs describe the reference's defaults; a workspace keeps later weeks' features off "
                    "until they are written: run this file without NANOSERVE_WORKSPACE")
    return code_options(engine_defaults(), cli_options())


# ------------------------------------------------------------------------------ the pages

SWITCH_PHRASES = [
    re.compile(r"\b(?P<v>on|off|served)\s+by\s+default\b", re.IGNORECASE),
    re.compile(r"(?<!by )\bdefault:\s*(?P<v>on|off|served)\b", re.IGNORECASE),
]
NUMBER = r"\d[\d,]*(?:\.\d+)?"
VALUE_PHRASES = [
    re.compile(r"\(default:?\s+(?P<v>[\w.,]*\w)"),  # (default 256), (default: fcfs)
    re.compile(r"(?<!by )\bdefault:\s+(?P<v>[\w.,]*\w)"),
    re.compile(r"\bdefaults?\s+to\s+(?:--[\w-]+\s+)?(?P<v>[\w.,]*\w)"),  # defaults to 1; defaults to --max-num-seqs 256
    re.compile(rf"(?P<v>{NUMBER})\s+(?:[a-z]+\s+)?by\s+default\b"),  # 300 by default; 16 tokens by default
    re.compile(rf"\bdefault\s+of\s+(?P<v>{NUMBER})"),
]
QUALIFIERS = re.compile(
    r"workspace|until week|once week|\bonly (?:once|when|if)\b|\bwhenever\b|\bunless\b|\bwith CUDA|on a GPU|"
    r"on CUDA|on the CPU|"
    r"\bwhen (?:it|chunked prefill|prefix caching) is on\b|\bwith (?:--enable-chunked-prefill|chunked prefill)\b",
    re.IGNORECASE,
)
FENCE = re.compile(r"^[ \t]*(```|~~~)[ \t]*(\w*)")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(*\[])")
CLAUSE_CUT = re.compile(r"[;:]\s|\s—\s|,\s+(?:and|but)\s|\),\s")


@dataclass
class Sentence:
    text: str
    starts: list[tuple[int, int]]  # (offset in text, line number) where each source line begins
    paragraph: int  # sentences of one paragraph share it
    heading: str  # of its section
    title: str  # of its page

    def line_at(self, offset: int) -> int:
        return max((o, n) for o, n in self.starts if o <= offset)[1]


def sentences(markdown: str) -> list[Sentence]:
    """The sentences of a page (headings included), each with its lines, paragraph and heading."""
    found: list[Sentence] = []
    title = heading = ""
    paragraph, block = 0, []  # block: (line number, text) of the paragraph being read
    fence, fence_lang = None, ""

    def add(lines: list[tuple[int, str]]) -> None:
        text, starts = "", []
        for number, part in lines:
            text += " " if text else ""
            starts.append((len(text), number))
            text += part
        cut = 0
        for m in [*SENTENCE_END.finditer(text), None]:
            end = m.start() if m else len(text)
            found.append(Sentence(text[cut:end], [(max(0, o - cut), n) for o, n in starts if o < end or o == 0],
                                  paragraph, heading, title))
            cut = m.end() if m else cut

    def flush() -> None:
        nonlocal block
        if block:
            add(block)
        block = []

    for number, line in enumerate(markdown.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == fence:
                fence = None
            elif fence_lang not in ("python", "py", "mermaid") and "#" in line:
                paragraph += 1
                add([(number, line.split("#", 1)[1].strip())])  # a comment in a shell block
            continue
        if m:
            flush()
            fence, fence_lang = m.group(1), m.group(2).lower()
            continue
        stripped = line.strip()
        if stripped.startswith("#"):
            flush()
            heading, paragraph = stripped.lstrip("#").strip(), paragraph + 1
            title = title or heading
            add([(number, heading)])
            continue
        if not stripped or stripped.startswith("|") or re.match(r"([-*+]|\d+\.)\s", stripped):
            flush()
            paragraph += 1
            if stripped.startswith("|"):  # a table row is a sentence of its own
                add([(number, stripped.replace("|", " ; "))])
                continue
            if not stripped:
                continue
        block.append((number, stripped))
    flush()
    return found


def _mentions(text: str, option: Option) -> list[int]:
    """Where a text names the option: its flags, its field in backticks, its prose names."""
    spots = []
    for flag in option.flags:
        spots += [m.start() for m in re.finditer(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    spots += [m.start() for m in re.finditer(rf"`{re.escape(option.key)}(?:=[^`]*)?`", text)]
    for name in PROSE.get(option.key, []):
        spots += [m.start() for m in re.finditer(rf"(?<![\w/-]){re.escape(name)}(?![\w-])", text, re.IGNORECASE)]
    return spots


def _nearest(text: str, at: int, candidates: list[Option], start: int = 0, end: int | None = None,
             count: int = 1) -> list[Option]:
    """The `count` options named nearest to position `at` within text[start:end], before it on a tie."""
    end = len(text) if end is None else end
    ranked = sorted((abs(spot - at), spot > at, option.key, option) for option in candidates
                    for spot in _mentions(text, option) if start <= spot < end)
    picked: list[Option] = []
    for *_, option in ranked:
        if option not in picked:
            picked.append(option)
    return picked[:count]


@dataclass
class Statement:
    page: str
    line: int
    option: str
    stated: object  # True/False for a switch, else the text of the value
    text: str

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _value_matches(option: Option, stated: str) -> bool:
    default = option.default
    if isinstance(default, (int, float)):
        try:
            return float(stated.replace(",", "")) == float(default)
        except ValueError:
            return False
    return stated.strip("`'\"").lower() == str(default).lower()


def statements(page: Path, options: dict[str, Option], root: Path = ROOT) -> list[Statement]:
    """Every statement of a default on a page, with the option it is about and the value it states."""
    switches = [o for o in options.values() if o.is_switch or not o.checked]
    scalars = [o for o in options.values()
               if not o.is_switch and (isinstance(o.default, (int, float, str)) or not o.checked)]
    found = []
    listed = sentences(page.read_text(encoding="utf-8"))
    for i, sentence in enumerate(listed):
        for patterns, candidates in ((SWITCH_PHRASES, switches), (VALUE_PHRASES, scalars)):
            for pattern in patterns:
                for m in pattern.finditer(sentence.text):
                    if _qualified(sentence.text, m.start(), m.end()):
                        continue  # a case ("on the CPU"), not the default
                    stated = m.group("v")
                    if patterns is SWITCH_PHRASES:
                        stated = stated.lower() != "off"
                    for option in _subjects(listed, i, m.start(), candidates):
                        if not option.checked:
                            continue
                        found.append(Statement(str(page.relative_to(root)), sentence.line_at(m.start()),
                                               option.key, stated, sentence.text.strip()))
    return found


def _clause(text: str, at: int) -> tuple[int, int]:
    """The bounds of the clause around position `at`: between semicolons, colons, dashes, ', and'."""
    cuts = [0, *(m.end() for m in CLAUSE_CUT.finditer(text)), len(text) + 1]
    return max(c for c in cuts if c <= at), min(c for c in cuts if c > at)


def _qualified(text: str, start: int, end: int, reach: int = 50) -> bool:
    """Whether a qualifier of `QUALIFIERS` stands within `reach` characters of the phrase at
    text[start:end], in its clause."""
    lo, hi = _clause(text, start)
    return bool(QUALIFIERS.search(text[max(lo, start - reach):min(hi, end + reach)]))


def _subjects(listed: list[Sentence], i: int, at: int, candidates: list[Option]) -> list[Option]:
    """The option a default phrase at position `at` of sentence i is about: the one named last before
    it in its clause, else in its sentence ("both default to 1": the two last). A sentence that
    starts with the phrase ("Off by default: `--flag` turns it on") takes the one named after it;
    one that names no option at all, the one named in the sentences before it in its paragraph,
    its heading, or its page's title."""
    text = listed[i].text
    count = 2 if re.search(r"\bboth\s+$", text[:at]) else 1
    clause_start = _clause(text, at)[0]
    found = _nearest(text, at, candidates, clause_start, at, count) or _nearest(text, at, candidates, 0, at, count)
    if found:
        return found
    if not re.sub(r"[*_(\[\s]|\bwhy\b", "", text[:at], flags=re.IGNORECASE):
        # "Off by default: `--enable-prefix-caching` turns it on": the subject follows, if anywhere
        return _nearest(text, at, candidates) or _subject_elsewhere(listed, i, candidates)
    if _nearest(text, at, candidates):
        return []  # the sentence names an option, but not as the subject of this phrase
    return _subject_elsewhere(listed, i, candidates)


def _subject_elsewhere(listed: list[Sentence], i: int, candidates: list[Option]) -> list[Option]:
    for earlier in reversed(listed[:i]):
        if earlier.paragraph != listed[i].paragraph:
            break
        if found := _nearest(earlier.text, len(earlier.text), candidates):
            return found
    for text in (listed[i].heading, listed[i].title):
        if found := _nearest(text, len(text), candidates):
            return found
    return []


def wrong(statement: Statement, options: dict[str, Option]) -> str | None:
    """Why a statement contradicts the code, or None."""
    option = options[statement.option]
    if isinstance(statement.stated, bool):
        if statement.stated == option.switched_on():
            return None
        return f"says {'on' if statement.stated else 'off'}, the code's default is {option.default!r}"
    if _value_matches(option, statement.stated):
        return None
    return f"says {statement.stated}, the code's default is {option.default!r}"


# ------------------------------------------------------------------------------ the tests


def test_every_statement_of_a_default_is_true(options):
    contradictions = []
    for page in pages():
        for s in statements(page, options):
            why = wrong(s, options)
            if why:
                contradictions.append(f"{s.where()}: {s.option} {why}\n    {s.text[:200]}")
    assert not contradictions, (
        "these pages state a default the code does not have (fix the page, or the code):\n"
        + "\n".join(contradictions)
    )


# Statements the search must find, whatever they say (a page, its option, text on its line): if
# the patterns stop finding them, the test above would pass without checking anything.
KNOWN = [
    ("README.md", "enable_prefix_caching", "Prefix caching is on by default"),
    ("weeks/README.md", "enable_prefix_caching", "On by default (`--no-enable-prefix-caching`"),
    ("docs/glossary.md", "enable_prefix_caching", "On by default; `--no-enable-prefix-caching`"),
    ("docs/architecture.md", "max_num_batched_tokens", "2,048 by default"),
    ("docs/glossary.md", "enable_chunked_prefill", "On by"),
    ("weeks/week08/README.md", "max_num_seqs", "(default 256)"),
    ("weeks/week18/README.md", "distributed_timeout", "300 by default"),
    ("docs/openai_api.md", "max_pending", "(default 512)"),
]


@pytest.mark.parametrize("page, option, text", KNOWN, ids=[f"{p}:{o}" for p, o, _ in KNOWN])
def test_statements_are_found(options, page, option, text):
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found = [s for s in statements(ROOT / page, options) if s.option == option]
    assert any(text in lines[s.line - 1] or text in s.text for s in found), (
        f"no statement of {option}'s default found in {page} where the text {text!r} is: "
        f"found {[(s.line, s.option) for s in statements(ROOT / page, options)]}"
    )


def test_a_wrong_default_is_caught(options, tmp_path: Path):
    """Plant wrong (and right) defaults in a page: exactly the wrong ones are reported, each with
    its line. The right values are read from the code, so the page follows the code's changes."""
    seqs = options["max_num_seqs"].default
    prefix_on = options["enable_prefix_caching"].switched_on()
    chunked_on = options["enable_chunked_prefill"].switched_on()
    say = {True: "on", False: "off"}
    page = tmp_path / "docs" / "planted.md"
    page.parent.mkdir()
    page.write_text(
        "# Planted\n\n"
        f"Prefix caching is {say[not prefix_on]} by default.\n\n"  # wrong
        f"- `--max-num-seqs` (default {seqs + 1}) sets the seats.\n"  # wrong
        f"- `--max-num-seqs` (default {seqs}) sets the seats.\n"  # right
        f"- Chunked prefill is {say[chunked_on]} by default.\n\n"  # right
        "## Week 17: speculative decoding\n\n"
        "On by default; it guesses tokens.\n\n"  # wrong: the subject comes from the heading
        "On the CPU prefix caching is off by default.\n",  # a case, not the default: not checked
        encoding="utf-8",
    )
    found = statements(page, options, root=tmp_path)
    reported = {(s.line, s.option) for s in found if wrong(s, options)}
    assert reported == {(3, "enable_prefix_caching"), (5, "max_num_seqs"), (11, "speculative")}
    assert {(s.line, s.option) for s in found} == reported | {(6, "max_num_seqs"), (7, "enable_chunked_prefill")}


def test_the_code_defaults_are_read(options):
    """The options this file checks come from the code: the engine's fields and the CLI's flags."""
    assert options["enable_prefix_caching"].flags == ["--enable-prefix-caching", "--no-enable-prefix-caching"]
    assert isinstance(options["enable_prefix_caching"].default, bool)  # resolved by the engine, not None
    assert options["metrics"].default is True and options["metrics"].flags == ["--no-metrics"]
    assert not options["port"].checked  # serve's 8000 and bench's 8471: no single default
    assert not options["dtype"].checked  # float32 on the CPU, bfloat16 on CUDA
