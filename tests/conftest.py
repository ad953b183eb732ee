"""Shared pytest setup: float32 determinism, a gpu marker that explains its skip, and Triton's
interpreter on machines without a GPU (it must be switched on before triton is first imported)."""

import json
import os
import sys
import tempfile
from pathlib import Path

# The learner's workspace (see nanoserve/course/workspace.py): when NANOSERVE_WORKSPACE names one, its
# copy of the package shadows the reference for every test, unchanged.
_workspace = os.environ.get("NANOSERVE_WORKSPACE")
if _workspace:
    sys.path.insert(0, str(Path(_workspace).resolve()))
    import nanoserve  # noqa: E402

    assert Path(nanoserve.__file__).resolve().is_relative_to(Path(_workspace).resolve()), nanoserve.__file__

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n 2`) each worker process computes on one thread: two workers on two cores
# then each have a core, instead of four threads fighting over two. The same goes for every process
# a test starts (servers, ranks, notebook kernels, the tests of the tests' inner runs): they inherit
# OMP_NUM_THREADS. Measured on the 2-core CI machine: four notebooks 125 s -> 74 s, weeks 10, 16 and
# 18 3:30 -> 2:50.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# ------------------------------------------------------------------ xdist groups
# `--dist loadgroup` (.ci/run) runs the tests marked `xdist_group(NAME)` on one worker: the large models
# never side by side, a GGUF file converted once per group, the pipeline stages one test at a time.
# pytest-xdist 3.8 does it by appending "@NAME" to each such test's node id on the workers, which pytest 9
# no longer lets a plugin do (a node id is now computed from the node, not stored): the groups were
# silently gone, and the Gemma 3 file was converted on both workers. So the workers write each grouped
# test's group to a file, and the controller's scheduler (xdist's hook `pytest_xdist_make_scheduler`)
# reads its work units from it. It overrides `_split_scope`, an internal method of xdist 3.8's
# LoadGroupScheduling (the one place it decides a test's unit): tests/test_xdist_groups.py fails if a
# later xdist changes that.
GROUPS_FILE = "NANOSERVE_XDIST_GROUPS_FILE"  # set by the controller, inherited by the workers it starts


_made_here: list[str] = []  # the groups file this process made (a test's own pytest inherits the variable)


def pytest_configure(config):
    if config.getoption("dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="nanoserve-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_FILE] = path
        _made_here.append(path)


def pytest_unconfigure(config):
    while _made_here:
        Path(_made_here.pop()).unlink(missing_ok=True)


def _write_groups(items) -> None:
    """On a worker: {node id: group} of the grouped tests, where the controller reads it (every worker
    collects the same tests; each writes the whole map and renames it into place)."""
    groups = {}
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names:
            groups[item.nodeid] = "_".join(names)
    path = Path(os.environ[GROUPS_FILE])
    mine = path.with_name(f"{path.name}.{os.environ.get('PYTEST_XDIST_WORKER', 'worker')}")
    mine.write_text(json.dumps(groups))
    os.replace(mine, path)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup" or not os.environ.get(GROUPS_FILE):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class MarkedGroups(LoadGroupScheduling):
        """Work units: a group's tests together, every other test alone. The workers have written the
        groups by the time the controller splits the collection (after every worker reported it)."""
        groups = None

        def _split_scope(self, nodeid):
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[GROUPS_FILE]).read_text() or "{}")
            return self.groups.get(nodeid, nodeid)

    return MarkedGroups(config, log)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput") and os.environ.get(GROUPS_FILE):
        _write_groups(items)
    # The tests of the tests (tests/course/test_workspace.py) run last: they take a good part of the
    # suite's time re-running every week on its own workspace, and a broken week shows sooner, and
    # more plainly, in its own tests. (A stable sort: every other test keeps its place.)
    items.sort(key=lambda item: item.path.parent.name == "course" and item.path.name == "test_workspace.py")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run on a GPU machine (see README, GPU track)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
