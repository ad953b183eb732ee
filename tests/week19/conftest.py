"""Week 19's tests convert GGUF files into a fresh cache of their own, never the user's (as week
13's do): a directory converted by an older or a learner's converter must not be read back here."""

import pytest

from nanoserve.testing import private_gguf_cache

_own_gguf_cache = pytest.fixture(scope="session", autouse=True)(private_gguf_cache)
