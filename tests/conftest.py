"""Shared pytest setup: float32 determinism, a gpu marker that explains its skip, and Triton's
interpreter on machines without a GPU (it must be switched on before triton is first imported)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
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
