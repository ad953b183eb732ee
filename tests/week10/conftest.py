"""Fixtures shared by week 10's server tests: the real server on the tiny model, the official
client pointed at it, and greedy offline generation to compare with."""

import pytest
from openai import OpenAI

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import ServerThread


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=dict(max_model_len=256, num_blocks=512)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny", device="cpu")

    def complete(prompt_ids, max_tokens, **kw):
        return llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens, **kw))[0]

    return llm, complete
