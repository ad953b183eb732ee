"""The course notebooks must run from top to bottom without an error.

Every `notebooks/*.ipynb` is executed in a fresh Jupyter kernel, from the `notebooks/` folder, as
a learner would run it. The kernel is pinned to the Python running pytest (through a kernelspec
written to a temporary directory and put first on JUPYTER_PATH), so that a `python3` kernel
installed elsewhere on the machine, with other packages, can never be picked up by mistake.

    pytest tests/test_notebooks.py          # needs the dev extras: pip install -e ".[dev]"
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300

nbformat = pytest.importorskip("nbformat", reason="needs the dev extras: pip install -e '.[dev]'")
nbclient = pytest.importorskip("nbclient", reason="needs the dev extras: pip install -e '.[dev]'")
pytest.importorskip("ipykernel", reason="needs the dev extras: pip install -e '.[dev]'")
pytest.importorskip("matplotlib", reason="needs the dev extras: pip install -e '.[dev]'")
from nbclient.exceptions import CellExecutionError  # noqa: E402


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A `python3` kernelspec that runs this very interpreter, and the environment the kernel inherits."""
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
    nb = nbformat.read(path, as_version=4)
    try:
        _run(nb)
    except CellExecutionError as e:
        # The message already holds the failing cell's source and the traceback.
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
