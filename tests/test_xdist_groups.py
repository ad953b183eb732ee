"""The suite's xdist groups hold: under `-n 2 --dist loadgroup` (.ci/run), the tests marked with one
`xdist_group` run on one worker (tests/conftest.py; pytest 9 broke pytest-xdist 3.8's own way of doing
it, and for a while nothing noticed). A small suite in a temporary folder, with this suite's conftest,
run by a pytest of its own."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="needs pytest-xdist: pip install -e '.[dev]'")

SUITE = '''
import json, os
from pathlib import Path

import pytest

OUT = Path(__file__).parent / "ran"


def record(name):
    (OUT / name).write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_one(i):
    record(f"one-{i}")


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    record(f"free-{i}")


@pytest.mark.xdist_group("two")
@pytest.mark.parametrize("i", range(4))
def test_two(i):
    record(f"two-{i}")
'''


def test_a_groups_tests_run_on_one_worker(tmp_path):
    suite = tmp_path / "tests"
    (suite / "ran").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "conftest.py", suite / "conftest.py")
    (suite / "test_grouped.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "NANOSERVE_XDIST"))}
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the controller writes the groups file
    (tmp_path / "tmp").mkdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", str(suite)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = {p.name: p.read_text() for p in (suite / "ran").iterdir()}
    assert len(ran) == 14, sorted(ran)
    for group in ("one", "two"):
        workers = {w for name, w in ran.items() if name.startswith(group)}
        assert len(workers) == 1, f"group {group!r} ran on {sorted(workers)}: {json.dumps(ran)}"
    assert not list((tmp_path / "tmp").glob("nanoserve-xdist-groups-*")), "the groups file is left behind"
