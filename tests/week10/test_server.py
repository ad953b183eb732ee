"""Week 10: the OpenAI-compatible server, with the official openai client and raw HTTP."""

import json
import threading

import httpx
import pytest
from openai import OpenAI

from nanoserve.testing import ServerThread

pytestmark = pytest.mark.exercise("engine-thread")


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.exercise("async-generate")
def test_completion_with_the_openai_client(client, reference):
    llm, complete = reference
    resp = client.completions.create(model="tiny", prompt="The list", max_tokens=12, temperature=0)
    expected = complete(llm.tokenizer.encode("The list"), 12)
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == {"stop": "stop", "length": "length"}[expected.finish_reason]
    assert resp.usage.prompt_tokens == len(llm.tokenizer.encode("The list"))
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.object == "text_completion" and resp.model == "tiny" and resp.id.startswith("cmpl-")


@pytest.mark.exercise("parse-params")
def test_length_finish_and_stop_strings(client):
    resp = client.completions.create(model="tiny", prompt="Return the", max_tokens=3, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3
    full = client.completions.create(model="tiny", prompt="Return the", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:6]
    cut = client.completions.create(model="tiny", prompt="Return the", max_tokens=10, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_chat_with_the_openai_client(client, reference):
    llm, complete = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    expected = complete(llm.tokenizer.apply_chat_template(messages), 10)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(messages))
    assert resp.object == "chat.completion"


@pytest.mark.exercise("parse-params")
def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny", prompt="The", max_tokens=12, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def post(server, path, body, headers=None, raw=None):
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json", **(headers or {})})


GOOD = {"model": "tiny", "prompt": "The list", "max_tokens": 4}
BAD = [
    ("malformed JSON", None, b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", None, b'["tiny"]', 400, None),
    ("missing model", {"prompt": "x"}, None, 400, "model"),
    ("unknown model", {**GOOD, "model": "gpt-9"}, None, 404, "model"),
    ("missing prompt", {"model": "tiny"}, None, 400, "prompt"),
    ("empty prompt", {**GOOD, "prompt": ""}, None, 400, "prompt"),
    ("prompt of wrong type", {**GOOD, "prompt": {"text": "x"}}, None, 400, "prompt"),
    ("max_tokens not an int", {**GOOD, "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("max_tokens < 1", {**GOOD, "max_tokens": 0}, None, 400, "max_tokens"),
    ("temperature < 0", {**GOOD, "temperature": -0.5}, None, 400, "temperature"),
    ("temperature is a string", {**GOOD, "temperature": "hot"}, None, 400, "temperature"),
    ("top_p = 0", {**GOOD, "top_p": 0}, None, 400, "top_p"),
    ("top_p > 1", {**GOOD, "top_p": 1.5}, None, 400, "top_p"),
    ("top_k < 0", {**GOOD, "top_k": -3}, None, 400, "top_k"),
    ("n < 1", {**GOOD, "n": 0}, None, 400, "n"),
    ("seed beyond 64 bits", {**GOOD, "seed": 2**64}, None, 400, "seed"),
    ("seed below -2**63", {**GOOD, "seed": -(2**63) - 1}, None, 400, "seed"),
    ("echo not a bool", {**GOOD, "echo": "yes"}, None, 400, "echo"),
    ("stop of wrong type", {**GOOD, "stop": 5}, None, 400, "stop"),
    ("stream not a bool", {**GOOD, "stream": "yes"}, None, 400, "stream"),
    ("beyond the context", {**GOOD, "max_tokens": 300}, None, 400, "max_tokens"),
    ("prompt alone beyond the context", {**GOOD, "prompt": "word " * 400, "max_tokens": 1}, None, 400, "prompt"),
]


@pytest.mark.exercise("parse-params")
@pytest.mark.parametrize("name,body,raw,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_requests(server, name, body, raw, status, param):
    resp = post(server, "/v1/completions", body, raw=raw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert post(server, "/v1/completions", GOOD).status_code == 200  # and the server still serves


@pytest.mark.parametrize("messages", [None, [], [{"role": "user"}], [{"role": "robot", "content": "x"}], "hi"])
def test_bad_chat_requests(server, messages):
    body = {"model": "tiny", "max_tokens": 4}
    if messages is not None:
        body["messages"] = messages
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_body_over_the_size_limit():
    with ServerThread(max_body_bytes=1000) as s:
        resp = post(s, "/v1/completions", {**GOOD, "prompt": "x" * 2000})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        assert post(s, "/v1/completions", GOOD).status_code == 200


def test_api_key():
    with ServerThread(api_key="sesame") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            resp = post(s, "/v1/completions", GOOD, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open for probes
        ok = OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="The", max_tokens=2).choices[0].text is not None


@pytest.mark.exercise("async-generate")
def test_a_full_queue_answers_429_with_retry_after():
    import time

    with ServerThread(max_pending=1) as s, s.slowed(0.05):
        long = {**GOOD, "max_tokens": 60, "ignore_eos": True}
        first = threading.Thread(target=post, args=(s, "/v1/completions", long))
        first.start()
        deadline = time.time() + 10
        while s.async_engine.num_pending == 0 and time.time() < deadline:
            time.sleep(0.01)  # until the first request is in flight
        busy = post(s, "/v1/completions", GOOD)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["code"] == "server_overloaded"
        first.join()
        assert s.wait_idle()
        assert post(s, "/v1/completions", GOOD).status_code == 200


def test_the_engine_runs_on_its_own_thread(server):
    names = {t.name for t in threading.enumerate()}
    assert "nanoserve-engine" in names
    assert server.async_engine.thread.is_alive()
