"""Fixtures shared by week 11's tests of the wider OpenAI fields in streams: the real server on
the tiny model (a context of 512 tokens: tool definitions make long prompts), and the official
client pointed at it."""

import pytest
from openai import OpenAI

from nanoserve.testing import ServerThread


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=dict(max_model_len=512, num_blocks=512)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
