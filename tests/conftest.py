"""Shared pytest setup: float32 determinism, a gpu marker that explains its skip, and Triton's
interpreter on machines without a GPU (it must be switched on before triton is first imported)."""

import os
import sys
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


def pytest_collection_modifyitems(config, items):
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
