"""Week 13's tests convert GGUF files into a fresh cache of their own, never the user's: a cache
left by the reference must not let a learner's stubbed dequantizers pass unseen."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _own_gguf_cache(tmp_path_factory):
    old = os.environ.get("NANOSERVE_CACHE_DIR")
    os.environ["NANOSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("nanoserve-cache"))
    yield
    if old is None:
        os.environ.pop("NANOSERVE_CACHE_DIR", None)
    else:
        os.environ["NANOSERVE_CACHE_DIR"] = old
