"""Week 11: SSE streaming byte for byte, concurrency, and cancellation on disconnect."""

import asyncio
import json
import re

import httpx
import pytest

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import ServerThread

pytestmark = pytest.mark.exercise("sse-events")

CHUNK_ID = re.compile(r"^(chatcmpl|cmpl)-[0-9a-f]{24}$")


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=dict(max_num_seqs=64, num_blocks=1024)) as s:
        yield s


def raw_stream(server, path, body):
    """The response body exactly as it crossed the wire."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return b"".join(resp.iter_raw())


def parse_events(raw: bytes) -> list[str]:
    """Split SSE framing: every event is 'data: <payload>' followed by one blank line."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n") and "\r" not in text
    events = text[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
    return [e[len("data: "):] for e in events]


def test_completion_sse_framing(server):
    body = {"model": "tiny", "prompt": "The list", "max_tokens": 12, "temperature": 0, "stream": True}
    payloads = parse_events(raw_stream(server, "/v1/completions", body))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and CHUNK_ID.match(chunks[0]["id"])
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices"}
        assert c["object"] == "text_completion" and c["model"] == "tiny"
        (choice,) = c["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and choice["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["text"] for c in chunks)
    plain = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}).json()
    assert text == plain["choices"][0]["text"]


def test_chat_sse_framing_with_usage(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    payloads = parse_events(raw_stream(server, "/v1/chat/completions", body))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] in ("stop", "length")
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert all(c["usage"] is None for c in chunks[:-1])
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert all(isinstance(d, str) and d for d in deltas)


def test_stop_strings_never_leak_into_the_stream(server):
    body = {"model": "tiny", "prompt": "Return the", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    full = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[6:9]
    payloads = parse_events(raw_stream(server, "/v1/completions", {**body, "stream": True, "stop": stop}))
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == full[: full.find(stop)] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_streaming_with_the_openai_client(client):
    plain = client.completions.create(model="tiny", prompt="A dictionary", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="A dictionary", max_tokens=16, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


PROMPTS = [f"{word} {i}" for i, word in enumerate(["The list", "Return the", "A dictionary", "If the", "This module",
                                                    "The default", "Create a", "An object"] * 8)]


def test_64_concurrent_streams_equal_offline_generation(server):
    params = dict(max_tokens=16, temperature=0)
    expected = LLM("tiny", device="cpu").generate(PROMPTS, SamplingParams(**params))

    async def one(client, prompt):
        body = {"model": "tiny", "prompt": prompt, "stream": True, **params}
        text, finish = "", None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return text, finish

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(main())
    assert len(results) == 64
    for (text, finish), exp in zip(results, expected):
        assert text == exp.text and finish == exp.finish_reason
    assert server.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):

    engine = server.engine
    with server.slowed(0.02):  # so the request is surely still running when the client leaves
        body = {"model": "tiny", "prompt": "The list", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine.scheduler.allocator.num_used > 0 and engine.has_unfinished()
        # The client is gone: the server aborts the request and every block comes back.
        assert server.wait_idle(timeout=10)
        assert not engine.requests and server.async_engine.num_pending == 0
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "The", "max_tokens": 3})
    assert ok.status_code == 200


def test_disconnect_during_a_plain_request_aborts_it(server):

    with server.slowed(0.02):
        body = {"model": "tiny", "prompt": "The list", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        assert server.wait_idle(timeout=10)


# --------------------------------------------------------- several prompts in one stream (issue 17)

BATCH = ["The list", "Return the", "A"]


def test_several_prompts_stream_with_their_index(server, client):
    """Issue 17: a list of prompts streams one choice per prompt, interleaved, each with its index."""
    llm = LLM("tiny", device="cpu")
    expected = llm.generate([llm.tokenizer.encode(p) for p in BATCH], SamplingParams(temperature=0, max_tokens=8))
    texts, reasons = ["", "", ""], [None, None, None]
    stream = client.completions.create(model="tiny", prompt=BATCH, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        (choice,) = chunk.choices
        assert reasons[choice.index] is None  # nothing after a choice's final chunk
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason
    assert texts == [e.text for e in expected]
    assert reasons == [{"stop": "stop", "length": "length"}[e.finish_reason] for e in expected]
    assert usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in BATCH)
    # The raw stream ends with one [DONE].
    body = {"model": "tiny", "prompt": BATCH, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    finals = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert sorted(c["index"] for c in finals if c["finish_reason"]) == [0, 1, 2]


def test_a_disconnect_aborts_every_prompt_of_a_stream(server):
    engine = server.engine
    with server.slowed(0.02):
        body = {"model": "tiny", "prompt": BATCH, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            for _ in range(8):
                next(lines)
            assert len(engine.requests) == 3
        assert server.wait_idle(timeout=10)
        assert not engine.requests and server.async_engine.num_pending == 0
    after = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "The", "max_tokens": 2},
                       timeout=60)
    assert after.status_code == 200
