"""Week 13's tests convert GGUF files into a fresh cache of their own, never the user's: a cache
left by the reference must not let a learner's stubbed dequantizers pass unseen."""

import pytest

from nanoserve.testing import private_gguf_cache

_own_gguf_cache = pytest.fixture(scope="session", autouse=True)(private_gguf_cache)
