"""Week 19's tests convert GGUF files into a fresh cache of their own, never the user's (as week
13's do): a directory converted by an older or a learner's converter must not be read back here."""

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
