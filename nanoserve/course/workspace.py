"""The learner's workspace: stubs generated from the reference (the commands: cli.py).

How it works. Every exercise in the reference `nanoserve/` sits between two marker comments:

    # >>> week01: rmsnorm
    ...reference solution...
    # <<< week01: rmsnorm

`start --week N` copies the package into `workspace/nanoserve/` and replaces the body of every
exercise of week N and later with `raise NotImplementedError(...)`, keeping the markers, the
signatures, the docstrings and all the code around them. You edit `workspace/nanoserve/`; the
reference stays untouched for `peek`. The tests are the same files for everyone: when the
environment variable NANOSERVE_WORKSPACE names a workspace, `tests/conftest.py` puts it first
on `sys.path`, so `import nanoserve` finds your copy instead of the reference. The notebooks
do the same in their first cell, and `notebook --week N` starts Jupyter with the variable set.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nanoserve.course.stubs import (
    COPIED,
    ENV_VAR,
    PACKAGE_DIR,
    source_files,
)

REPO_DIR = PACKAGE_DIR.parent
DEFAULT_WORKSPACE = REPO_DIR / "workspace"
NOTEBOOK_DIR = REPO_DIR / "notebooks"

BEGIN = re.compile(r"^(?P<indent>\s*)# >>> week(?P<week>\d\d): (?P<name>[a-z0-9-]+)\s*$")
END = re.compile(r"^(?P<indent>\s*)# <<< week(?P<week>\d\d): (?P<name>[a-z0-9-]+)\s*$")
STUB_MARK = "NotImplementedError(\"week"


class MarkerError(ValueError):
    """A marker pair that is not well formed (unclosed, mismatched, nested, mis-indented)."""


@dataclass
class Exercise:
    week: int
    name: str
    path: Path  # relative to the package directory
    begin: int  # line index of the `# >>>` marker
    end: int  # line index of the `# <<<` marker
    indent: str

    @property
    def key(self) -> str:
        return f"week{self.week:02d}:{self.name}"

    def body(self, lines: list[str]) -> list[str]:
        return lines[self.begin + 1 : self.end]

    def stub(self) -> list[str]:
        return [f'{self.indent}raise NotImplementedError("week {self.week:02d} exercise \'{self.name}\': '
                f'see weeks/week{self.week:02d}/README.md")\n']


def find_exercises(lines: list[str], path: Path) -> list[Exercise]:
    """Parse the marker pairs of one file (raises MarkerError on any malformed pair)."""
    found, open_ = [], None
    for i, line in enumerate(lines):
        begin, end = BEGIN.match(line), END.match(line)
        stripped = line.lstrip()
        if stripped.startswith("# >>>") and not begin or stripped.startswith("# <<<") and not end:
            raise MarkerError(f"{path}:{i + 1}: malformed marker {line.strip()!r} "
                              "(expected '# >>> weekNN: name' / '# <<< weekNN: name')")
        if begin:
            if open_ is not None:
                raise MarkerError(f"{path}:{i + 1}: marker opened inside {open_[1]}")
            if not begin["indent"]:
                raise MarkerError(f"{path}:{i + 1}: exercises must sit inside a function body")
            open_ = (i, f"week{begin['week']}: {begin['name']}", begin)
        elif end:
            if open_ is None:
                raise MarkerError(f"{path}:{i + 1}: closing marker without an opening one")
            start, label, b = open_
            if (end["week"], end["name"], end["indent"]) != (b["week"], b["name"], b["indent"]):
                raise MarkerError(f"{path}:{i + 1}: closing marker does not match '{label}' (line {start + 1})")
            if i == start + 1:
                raise MarkerError(f"{path}:{i + 1}: exercise '{label}' is empty")
            found.append(Exercise(int(b["week"]), b["name"], path, start, i, b["indent"]))
            open_ = None
    if open_ is not None:
        raise MarkerError(f"{path}:{open_[0] + 1}: exercise '{open_[1]}' is never closed")
    return found


def all_exercises(package: Path = PACKAGE_DIR) -> list[Exercise]:
    exercises = []
    for rel in source_files(package):
        exercises += find_exercises((package / rel).read_text().splitlines(keepends=True), rel)
    keys = [e.key for e in exercises]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise MarkerError(f"exercise names must be unique: {', '.join(sorted(dupes))}")
    return exercises


def weeks_with_exercises(package: Path = PACKAGE_DIR) -> list[int]:
    return sorted({e.week for e in all_exercises(package)})


def is_stub(body: list[str]) -> bool:
    return len(body) == 1 and STUB_MARK in body[0]


# ------------------------------------------------------------------------ making the workspace


def dedent(body: list[str], indent: str) -> list[str]:
    """An exercise's body without the indentation of its markers (blank lines kept)."""
    return [line[len(indent):] if line.startswith(indent) else line for line in body]


def indent_to(body: list[str], indent: str) -> list[str]:
    """`dedent`'s inverse: the body at the indentation of the markers it goes between."""
    return [indent + line if line.strip() else line for line in body]


def learner_answers(package: Path) -> dict[str, list[str]]:
    """Every exercise the learner has written in a workspace package, by exercise key, whatever
    file it sits in: {'week03:sample': body without its indentation}. Stubs are left out. Keyed by
    exercise, not by file, so an answer follows its exercise when the reference moves code from
    one module to another (the layered package of the layered-house change, for one)."""
    answers: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        lines = path.read_text().splitlines(keepends=True)
        for ex in find_exercises(lines, path.relative_to(package)):
            body = ex.body(lines)
            if not is_stub(body):
                answers[ex.key] = dedent(body, ex.indent)
    return answers


def render(reference_lines: list[str], exercises: list[Exercise], week: int,
           answers: dict[str, list[str]] | None = None) -> list[str]:
    """One module of the workspace: exercises of week >= `week` stubbed, the others solved.

    The learner's own answers (`learner_answers`: neither a stub nor a copy of the reference)
    are kept, whatever the week and whichever file they came from: `start` never throws work away.
    """
    answers = answers or {}
    out, cursor = [], 0
    for ex in exercises:
        out += reference_lines[cursor : ex.begin + 1]
        mine = answers.get(ex.key)
        if mine is not None and mine != dedent(ex.body(reference_lines), ex.indent):
            out += indent_to(mine, ex.indent)
        elif ex.week >= week:
            out += ex.stub()
        else:
            out += ex.body(reference_lines)
        out.append(reference_lines[ex.end])
        cursor = ex.end + 1
    return out + reference_lines[cursor:]


def make_workspace(week: int, workspace: Path = DEFAULT_WORKSPACE, keep_learner_work: bool = True) -> Path:
    """Create or update `workspace/nanoserve` stubbed from `week` on. Returns the package path.

    A workspace made from an older layout of the reference keeps every answer (they are carried
    by exercise key); its modules that the reference no longer has are moved, untouched, to
    `workspace/replaced/`, so nothing there can shadow the new modules and nothing is lost."""
    target = workspace / "nanoserve"
    answers = learner_answers(target) if keep_learner_work and target.exists() else {}
    target.mkdir(parents=True, exist_ok=True)
    for rel in source_files():
        ref_lines = (PACKAGE_DIR / rel).read_text().splitlines(keepends=True)
        exercises = find_exercises(ref_lines, rel)
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text("".join(render(ref_lines, exercises, week, answers)))
    for rel in COPIED:  # the course's stub finder, so the workspace's engine can ask it
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGE_DIR / rel, target / rel)
    retired = retire_stale_modules(target, workspace / "replaced")
    if retired:
        print(f"moved {len(retired)} module(s) the reference no longer has to {workspace / 'replaced'}: "
              f"{', '.join(str(p) for p in retired)} (your answers in them were carried over)")
    assets = PACKAGE_DIR / "assets"
    if assets.exists():
        shutil.copytree(assets, target / "assets", dirs_exist_ok=True)
    (workspace / "WEEK").write_text(f"{week}\n")
    return target


def retire_stale_modules(target: Path, attic: Path) -> list[Path]:
    """Move the workspace's Python files that the reference does not have to `attic` (same
    relative paths), and drop the folders that leaves empty. Returns the moved paths."""
    keep = set(source_files()) | set(COPIED)
    moved = []
    for path in sorted(target.rglob("*.py")):
        rel = path.relative_to(target)
        if "__pycache__" in rel.parts or rel in keep:
            continue
        (attic / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), attic / rel)
        moved.append(rel)
    for folder in sorted((p for p in target.rglob("*") if p.is_dir()), reverse=True):
        if not any(f for f in folder.rglob("*") if f.is_file() and "__pycache__" not in f.parts):
            shutil.rmtree(folder)
    return moved


def find_exercise(name: str) -> list[Exercise]:
    """The reference's exercises called `name` ('rmsnorm', 'week01:rmsnorm' or 'week01: rmsnorm').
    Raises KeyError, listing every exercise, if there is none."""
    matches = [e for e in all_exercises() if name in (e.name, e.key, e.key.replace(":", ": "))]
    if not matches:
        known = ", ".join(e.key for e in all_exercises())
        raise KeyError(f"no exercise named {name!r}; the exercises are: {known}")
    return matches


def written_exercises(keys: set[str], workspace: Path = DEFAULT_WORKSPACE) -> list[str]:
    """Those of the exercises `keys` that hold the learner's code (no stub) in the workspace."""
    weeks = sorted({int(key[4:6]) for key in keys})  # 'week03:sample' -> 3
    written = [f"week{w:02d}:{name}" for w in weeks for name, mine in exercise_status(w, workspace) if mine]
    return [key for key in written if key in keys]


def reset_exercises(keys: set[str], workspace: Path = DEFAULT_WORKSPACE) -> int:
    """Put back the stubs of the exercises `keys` ('week03:sample', ...) in the workspace,
    discarding what the learner wrote there. Returns how many."""
    target = workspace / "nanoserve"
    count = 0
    for rel in source_files():
        dest = target / rel
        if not dest.exists():
            continue
        lines = dest.read_text().splitlines(keepends=True)
        exercises = [e for e in find_exercises(lines, rel) if e.key in keys]
        for ex in reversed(exercises):  # from the bottom, so line numbers above stay valid
            lines[ex.begin + 1 : ex.end] = ex.stub()
            count += 1
        if exercises:
            dest.write_text("".join(lines))
    return count


def week_keys(week: int) -> set[str]:
    return {e.key for e in all_exercises() if e.week == week}


def peek(name: str) -> str:
    """The reference solution of one exercise ('rmsnorm' or 'week01:rmsnorm')."""
    out = []
    for ex in find_exercise(name):
        lines = (PACKAGE_DIR / ex.path).read_text().splitlines(keepends=True)
        out.append(f"--- {ex.key}  (nanoserve/{ex.path}, lines {ex.begin + 2}-{ex.end})\n")
        out += [line[len(ex.indent):] if line.startswith(ex.indent) else line for line in ex.body(lines)]
    return "".join(out)


# ------------------------------------------------------------------------------ exercise status


def exercise_status(week: int, workspace: Path) -> list[tuple[str, bool]]:
    """(exercise name, written?) for one week's exercises in the workspace, in file order."""
    status = []
    for rel in source_files():
        dest = workspace / "nanoserve" / rel
        if dest.exists():
            lines = dest.read_text().splitlines(keepends=True)
            status += [(e.name, not is_stub(e.body(lines))) for e in find_exercises(lines, rel) if e.week == week]
    return status


# ------------------------------------------------------------------------------- notebooks


def week_notebooks(week: int) -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob(f"week{week:02d}_*.ipynb"))


def notebook_command(week: int, workspace: Path = DEFAULT_WORKSPACE, no_browser: bool = False,
                     jupyter_args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command that opens week N's notebook in JupyterLab, and the variables it adds to the
    environment: NANOSERVE_WORKSPACE, which the notebook's first cell reads. It runs in the
    repository root. Raises FileNotFoundError if the week has no notebook or there is no workspace."""
    notebooks = week_notebooks(week)
    if not notebooks:
        have = sorted({int(p.name[4:6]) for p in NOTEBOOK_DIR.glob("week[0-9][0-9]_*.ipynb")})
        raise FileNotFoundError(f"week {week} has no notebook (the weeks with one: "
                                f"{', '.join(map(str, have))})")
    if not (workspace / "nanoserve").is_dir():
        raise FileNotFoundError(f"no workspace at {workspace}: run `nanoserve course start --week {week}` first")
    cmd = [sys.executable, "-m", "jupyterlab", *(str(p.relative_to(REPO_DIR)) for p in notebooks)]
    if no_browser:
        cmd.append("--no-browser")
    cmd += jupyter_args or []
    return cmd, {ENV_VAR: str(Path(workspace).resolve())}


def open_notebook(week: int, workspace: Path = DEFAULT_WORKSPACE, no_browser: bool = False,
                  dry_run: bool = False, jupyter_args: list[str] | None = None) -> int:
    """`notebook --week N`: print what it will run (and stop there with `dry_run`), then run
    JupyterLab until it is shut down. Returns an exit status."""
    try:
        cmd, extra_env = notebook_command(week, workspace, no_browser, jupyter_args)
    except FileNotFoundError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items()) + " " + shlex.join(cmd)
    if dry_run:
        print(f"in {REPO_DIR}:")
        print(line)
        return 0
    if importlib.util.find_spec("jupyterlab") is None:
        print("JupyterLab is not installed in this environment: `pip install -e '.[dev]'` "
              "(or `pip install jupyterlab`)", file=sys.stderr)
        return 2
    stubs = [f"week{w:02d}:{name}" for w in range(1, week + 1)
             for name, written in exercise_status(w, workspace) if not written]
    names = ", ".join(f"notebooks/{p.name}" for p in week_notebooks(week))
    print(f"Opening {names} on your workspace, {workspace / 'nanoserve'}")
    if stubs:
        print(f"Still stubs there, up to week {week}: {', '.join(stubs)}. The cells that reach them "
              "raise NotImplementedError.")
    print("After you change your code, restart the kernel: Python imports a module only once.")
    if no_browser:
        print("Open the address JupyterLab prints below in a browser (through an ssh tunnel from a "
              "remote machine), then the notebook from the file list.")
    print(line, flush=True)
    child = subprocess.Popen(cmd, cwd=REPO_DIR, env={**os.environ, **extra_env})
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:  # Jupyter got the Ctrl-C too: let it ask and shut down itself
            continue
