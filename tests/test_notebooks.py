"""The course notebooks run from top to bottom without an error, and keep their questions open.

1. **They run.** Every `notebooks/*.ipynb` is executed in a fresh Jupyter kernel, from the
   `notebooks/` folder, as a learner would run it. The kernel is pinned to the Python running
   pytest (through a kernelspec written to a temporary directory and put first on JUPYTER_PATH),
   so that a `python3` kernel installed elsewhere on the machine, with other packages, can never
   be picked up by mistake. These tests are slow (marked `slow`).

2. **No stored answers** (fast: reads the JSON, executes nothing). A notebook asks its questions
   in a section whose Markdown heading starts with "Your turn" (`## Your turn: predict, then run`,
   `## 5. Your turn: a Q4_1 quantizer`): the learner writes a guess into a `my_...` name
   (`my_guess`, `my_call`, `MY_LINK_GBPS`) and runs the cell, which prints the answer beside the
   guess. Such cells are committed without outputs, or the file the learner opens shows the
   answer before they have guessed. `question_cells` finds them: every code cell of a "Your turn"
   (or "Predict") section, up to the next heading, and every code cell anywhere that names a
   `my_...` variable (a cell that prints the guess beside the answer reveals it). CI executes
   them; it never stores them.

    pytest tests/test_notebooks.py -m "not slow"   # the fast checks
    pytest tests/test_notebooks.py                  # and the notebooks, executed (dev extras needed)
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300

DEV_EXTRAS = "needs the dev extras: pip install -e '.[dev]'"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A `python3` kernelspec that runs this very interpreter, and the environment the kernel inherits."""
    # Only the executing tests need Jupyter: the fast checks below read the JSON and never skip.
    for module in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
        pytest.importorskip(module, reason=DEV_EXTRAS)
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (nanoserve tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    # JUPYTER_PATH comes before the user's and the system's Jupyter directories.
    monkeypatch.setenv("JUPYTER_PATH", _prepend(tmp_path / "jupyter", "JUPYTER_PATH"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The kernel runs in notebooks/: make sure it imports *this* checkout's nanoserve even
    # when nanoserve is not installed (an editable install makes this a no-op).
    monkeypatch.setenv("PYTHONPATH", _prepend(ROOT, "PYTHONPATH"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # silences a debugger warning


def _prepend(path: Path, variable: str) -> str:
    rest = [p for p in os.environ.get(variable, "").split(os.pathsep) if p]
    return os.pathsep.join([str(path), *rest])


def _run(nb) -> None:
    import nbclient

    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},  # the kernel's working directory
    )
    client.execute()


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"


@pytest.mark.slow
def test_kernel_is_this_python(kernel_env):
    """The kernel the notebooks run in is the interpreter running pytest, started in notebooks/."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("import os, sys\nprint(sys.prefix)\nprint(os.getcwd())"))
    _run(nb)
    prefix, cwd = nb.cells[0].outputs[0]["text"].splitlines()
    # sys.prefix, not sys.executable: a venv's python is a symlink to the system one, and only
    # the prefix tells two environments apart.
    assert prefix == sys.prefix
    assert Path(cwd).resolve() == NOTEBOOK_DIR.resolve()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_env):
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    try:
        _run(nb)
    except CellExecutionError as e:
        # The message already holds the failing cell's source and the traceback.
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)


# ------------------------------------------------------------------ questions kept open

HEADING = re.compile(r"^#{1,6}\s+(.*)$", re.MULTILINE)
QUESTION_HEADING = re.compile(r"^(?:\d+\.\s*)?(?:your turn|predict)\b", re.IGNORECASE)
GUESS_NAME = re.compile(r"\bmy_\w+", re.IGNORECASE)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def question_cells(notebook: dict) -> list[int]:
    """The indices of the code cells that ask a question or reveal its answer: those of a section
    headed "Your turn ..." or "Predict ..." (until the next heading), and any that names a `my_...`
    guess."""
    found, in_question = [], False
    for i, cell in enumerate(notebook["cells"]):
        text = _source(cell)
        if cell["cell_type"] == "markdown":
            headings = HEADING.findall(text)
            if headings:  # the last heading of the cell decides which section follows it
                in_question = bool(QUESTION_HEADING.match(headings[-1].strip()))
        elif cell["cell_type"] == "code" and (in_question or GUESS_NAME.search(text)):
            found.append(i)
    return found


def stored_answers(notebook: dict) -> list[int]:
    """The question cells committed with outputs."""
    return [i for i in question_cells(notebook) if notebook["cells"][i].get("outputs")]


def _notebook(*cells: tuple[str, str, list]) -> dict:
    """A minimal notebook of (cell type, source, outputs) triples, as the .ipynb JSON holds it."""
    out = []
    for kind, source, outputs in cells:
        cell = {"cell_type": kind, "metadata": {}, "source": source.splitlines(keepends=True)}
        if kind == "code":
            cell.update(outputs=outputs, execution_count=1 if outputs else None)
        out.append(cell)
    return {"cells": out, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def check_no_stored_answers(path: Path) -> None:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    stored = stored_answers(notebook)
    assert not stored, (
        f"{path.name}: cell {', '.join(map(str, stored))} asks a question or reveals its answer "
        f"(a 'Your turn' section, or a my_... guess) and is committed with its outputs, so the "
        f"notebook shows the answer before the learner guesses. Clear the outputs of those cells "
        f"(Jupyter: select them, Edit > Clear Outputs) and save; CI executes them, it never stores them."
    )


ANSWER = [{"output_type": "stream", "name": "stdout", "text": ["one per step: hit rate 0.778   (your guess: None)\n"]}]


def test_question_cells_are_found():
    nb = _notebook(
        ("markdown", "# Week 99\n\nIntro.", []),
        ("code", "x = 1", ANSWER),  # outputs allowed: an ordinary cell
        ("markdown", "## Your turn: predict, then run\n\nHow many?", []),
        ("code", "my_guess = None\nprint(answer(), my_guess)", []),
        ("markdown", "A hint, no heading: still the same section.", []),
        ("code", "print(answer())", []),  # reveals, inside the section
        ("markdown", "## 2. The next section", []),
        ("code", "plot()", ANSWER),
        ("code", "print(f'(your guess: {MY_GUESS})')", []),  # names a guess: a reveal, wherever it is
        ("markdown", "## 3. Your turn: write it", []),
        ("code", "# Your code here.", []),
    )
    assert question_cells(nb) == [3, 5, 8, 10]
    assert stored_answers(nb) == []


def test_a_stored_answer_is_flagged(tmp_path: Path):
    """Plant an answer in a notebook file, as a committed notebook would hold it: the check names it."""
    planted = _notebook(
        ("markdown", "## Your turn: predict, then run\n\nWhat hit rate?", []),
        ("code", "my_guess = None\nprint(hit_rate, my_guess)", ANSWER),
        ("markdown", "## Your turn: one more", []),
        ("code", "print(steps)", []),
    )
    path = tmp_path / "week99_planted.ipynb"
    path.write_text(json.dumps(planted, indent=1))
    assert stored_answers(json.loads(path.read_text())) == [1]
    with pytest.raises(AssertionError, match=r"week99_planted.ipynb.*cell 1"):
        check_no_stored_answers(path)
    # Cleared as the fix says, it passes.
    planted["cells"][1].update(outputs=[], execution_count=None)
    path.write_text(json.dumps(planted, indent=1))
    check_no_stored_answers(path)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_asks_a_question(path):
    """Every notebook has a "Your turn" section with a cell to write in (so the check above sees
    something: a renamed heading would make it pass vacuously)."""
    assert question_cells(json.loads(path.read_text(encoding="utf-8"))), (
        f"{path.name} has no 'Your turn' section (a Markdown heading starting 'Your turn' followed by a "
        f"code cell) and no my_... guess: the course's notebooks end with one"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_questions_are_committed_without_answers(path):
    check_no_stored_answers(path)
