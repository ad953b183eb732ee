"""Week 10: the server's handlers are plain functions of a `ServerState` (and of the `ServedModel` a
request names) and the request, so they can be called without HTTP, a model or an engine thread:
here with a stand-in for the `AsyncEngine` that only answers what the server may ask of it."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from nanoserve.sampling.params import SamplingParams
from nanoserve.server import engine_calls, handlers
from nanoserve.server.handlers import ServerState
from nanoserve.server.models import ModelRegistry, ServedModel
from nanoserve.server.protocol import APIError


def fake_engine(failed: str | None = None) -> SimpleNamespace:
    tokenizer = SimpleNamespace(encode=lambda text: [1] * len(text.split()), takes_tools=False)
    return SimpleNamespace(tokenizer=tokenizer, max_model_len=32, vocab_size=100, failed=failed,
                           num_pending=2, kv_blocks=lambda: (5, 8), scheduling_policy="fcfs", lora_names=(),
                           listeners=[])


def state(**kwargs) -> ServerState:
    return ServerState(ModelRegistry.serving(fake_engine(**kwargs), "tiny"), created=1234)


def model(**kwargs) -> ServedModel:
    """The served model, as a handler gets it for a request that names it."""
    return state(**kwargs).models.loaded()[0]


class FakeRequest:
    """What `read_json` reads of a Starlette request: its body, as it arrives (in 1,000-byte chunks)."""

    def __init__(self, body: bytes):
        self._body = body

    async def stream(self):
        for start in range(0, len(self._body), 1000):
            yield self._body[start:start + 1000]


def test_health_and_models():
    assert handlers.health(state()) == {"status": "ok", "requests_in_flight": 2, "kv_blocks_free": 5,
                                        "kv_blocks_total": 8}
    failed = handlers.health(state(failed="rank 1 exited"))
    assert failed.status_code == 503
    assert json.loads(failed.body) == {"status": "failed", "error": "rank 1 exited"}
    assert handlers.list_models(state())["data"] == [{"id": "tiny", "object": "model", "created": 1234,
                                                      "owned_by": "nanoserve", "max_model_len": 32}]


def test_read_json_checks_the_body_and_the_model():
    s = state()
    assert asyncio.run(handlers.read_json(s, FakeRequest(b'{"model": "tiny", "n": 1}'))) == {"model": "tiny", "n": 1}
    for raw, status, param in [(b"{not json", 400, None), (b"[1]", 400, None), (b"{}", 400, "model"),
                               (b'{"model": "gpt-4o"}', 404, "model"), (b" " * (s.max_body_bytes + 1), 413, None)]:
        with pytest.raises(APIError) as e:
            asyncio.run(handlers.read_json(s, FakeRequest(raw)))
        assert (e.value.status, e.value.param) == (status, param), raw[:20]


def test_check_length_names_the_culprit():
    s = model()  # a context of 32 tokens
    engine_calls.check_length(s, [1] * 16, SamplingParams(max_tokens=16), "prompt")
    with pytest.raises(APIError) as e:
        engine_calls.check_length(s, [1] * 16, SamplingParams(max_tokens=17), "prompt")
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(APIError) as e:
        engine_calls.check_length(s, [1] * 32, SamplingParams(max_tokens=1), "prompt[2]")
    assert e.value.param == "prompt[2]"


def test_completion_prompts():
    assert handlers.completion_prompts("hi") == (["hi"], ["prompt"])
    assert handlers.completion_prompts([3, 4]) == ([[3, 4]], ["prompt"])
    assert handlers.completion_prompts(["a", "b"]) == (["a", "b"], ["prompt[0]", "prompt[1]"])
    with pytest.raises(APIError) as e:
        handlers.completion_prompts(["a", [3]])
    assert e.value.param == "prompt[1]"
    prompts, names = handlers.completion_prompts(None)  # no prompt: the token-id check names it
    with pytest.raises(APIError) as e:
        handlers.prompt_token_ids(model(), prompts[0], names[0])
    assert e.value.param == "prompt"
    assert handlers.prompt_token_ids(model(), "two words", "prompt") == [1, 1]
    with pytest.raises(APIError):
        handlers.prompt_token_ids(model(), [5, 100], "prompt")  # 100 is outside the vocabulary
