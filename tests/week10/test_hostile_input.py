"""Issue 30: bodies that used to reach a 500 (Python's own limits: a 4,300-digit integer, the
recursion limit, a tokenizer that cannot take half a UTF-16 pair, `int()` reading digits that are
not ASCII) answer 400 in OpenAI's error shape, and the next request on the same keep-alive
connection is served."""

import json

import httpx
import pytest

from nanoserve.sampling.params import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingParams,
)
from nanoserve.server.protocol import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    MAX_STOP,
    APIError,
    load_json,
)
from nanoserve.testing import ServerThread

CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]'  # a body, open
COMPLETION = '{"model": "tiny", "max_tokens": 2, "prompt": "The list"'


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def tool_call_with(arguments: str) -> str:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return json.dumps({"model": "tiny", "max_tokens": 2, "messages": messages})


HOSTILE = [  # (name, path, raw body, the error's param, a word of its message)
    ("a 5,000-digit max_tokens", "/v1/completions", COMPLETION + ', "max_tokens": ' + "1" * 5000 + "}",
     None, "digits"),
    ("messages nested 100,000 deep", "/v1/chat/completions",
     '{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "deep"),
    ("metadata nested 50,000 deep", "/v1/chat/completions", CHAT + ', "metadata": ' + nested(50_000) + "}",
     None, "deep"),
    ("tool call arguments nested 50,000 deep", "/v1/chat/completions", tool_call_with(nested(50_000)),
     "messages[1].tool_calls[0].function.arguments", "deep"),
    ("a lone surrogate in chat content", "/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content", "Unicode"),
    ("a lone surrogate in a prompt", "/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', "prompt", "Unicode"),
    ("a lone surrogate in tool call arguments", "/v1/chat/completions", tool_call_with('{"a": "\\udc00"}'),
     "messages[1].tool_calls[0].function.arguments.a", "Unicode"),
    ("logit_bias key ²", "/v1/completions", COMPLETION + ', "logit_bias": {"\u00b2": 1}}', "logit_bias.\u00b2", "ASCII"),
    ("logit_bias key in Arabic-Indic digits", "/v1/completions", COMPLETION + ', "logit_bias": {"\u0661\u0662": 1}}',
     "logit_bias.\u0661\u0662", "ASCII"),
    ("logit_bias key of 5,000 ASCII digits", "/v1/completions", COMPLETION + ', "logit_bias": {"' + "1" * 5000 + '": 1}}',
     "logit_bias." + "1" * 5000, "token id"),
]


@pytest.fixture(scope="module")
def connection(server):
    """One keep-alive connection: a request that broke it would fail the one after it."""
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        yield client


@pytest.mark.parametrize("name,path,raw,param,word", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_are_400s_and_the_connection_lives(connection, name, path, raw, param, word):
    resp = connection.post(path, content=raw.encode("utf-8"), headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and word in error["message"], error
    good = connection.post("/v1/completions", json={"model": "tiny", "prompt": "The list", "max_tokens": 2})
    assert good.status_code == 200, good.text


def test_load_json_limits():
    assert load_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None  # at the limit: fine
    assert load_json('{"s": "' + "[" * 1000 + '"}') == {"s": "[" * 1000}  # brackets inside strings are text
    assert load_json(str(2**64 - 1)) == 2**64 - 1 and len(str(2**64 - 1)) <= MAX_INT_DIGITS  # any 64-bit seed
    assert load_json('"\\ud83d\\ude00"') == "\U0001F600"  # a surrogate pair is one character
    assert load_json('"\\\\ud800"') == "\\ud800"  # an escaped backslash, then text
    for text in ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "1" * (MAX_INT_DIGITS + 1),
                 "-" + "1" * (MAX_INT_DIGITS + 1), '["\\udfff"]', '{"\\ud800": 1}', b'{"a": \xff}'):
        with pytest.raises(APIError) as e:
            load_json(text)
        assert e.value.status == 400


# ------------------------------------------------------------------- degenerate sampling values

DEGENERATE = [  # each used to answer 200 with every token <|begin_of_text|> and empty text
    ("temperature", 1e-38), ("temperature", MIN_TEMPERATURE / 2), ("top_p", 5e-324), ("top_p", MIN_TOP_P / 2),
    ("repetition_penalty", 1e-40), ("repetition_penalty", MAX_REPETITION_PENALTY * 2),
]


@pytest.mark.parametrize("name,value", DEGENERATE, ids=[f"{n}={v:g}" for n, v in DEGENERATE])
def test_degenerate_sampling_values_are_400s(connection, name, value):
    resp = connection.post("/v1/completions", json={"model": "tiny", "prompt": "The list", "max_tokens": 2,
                                                    name: value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == name
    with pytest.raises(ValueError, match=name):  # the engine refuses them too
        SamplingParams(**{name: value})


def test_the_edges_of_the_sound_ranges_sample(connection):
    edges = [{"temperature": 0}, {"temperature": MIN_TEMPERATURE}, {"top_p": MIN_TOP_P},
             {"repetition_penalty": MIN_REPETITION_PENALTY}, {"repetition_penalty": MAX_REPETITION_PENALTY}]
    for fields in edges:
        resp = connection.post("/v1/completions", json={"model": "tiny", "prompt": "The list", "max_tokens": 3,
                                                        "ignore_eos": True, "seed": 1, **fields})
        assert resp.status_code == 200, (fields, resp.text)
        assert resp.json()["choices"][0]["text"].strip(), fields  # a real token, not <|begin_of_text|> thrice


# ------------------------------------------------------------------------ a request that never fits


def test_more_choices_than_max_pending_is_a_400_not_a_429():
    with ServerThread(max_pending=4) as s:
        url = s.url + "/v1/completions"
        for fields, param in [({"n": 5}, "n"), ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
                              ({"prompt": ["a", "b", "c"], "n": 2}, "n")]:
            resp = httpx.post(url, json={"model": "tiny", "prompt": "The list", "max_tokens": 2, **fields}, timeout=60)
            assert resp.status_code == 400, resp.text  # on an idle server: retrying could never help
            assert resp.json()["error"]["param"] == param and "--max-pending 4" in resp.json()["error"]["message"]
        fits = httpx.post(url, json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2}, timeout=60)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


# -------------------------------------------------------------------- integers written as floats


def test_whole_number_floats_are_integers(connection):
    # what Python clients and JSON encoders send for a whole float
    resp = connection.post("/v1/completions", json={"model": "tiny", "prompt": "The list", "max_tokens": 4.0,
                                                    "n": 2.0, "seed": 3.0, "logprobs": 1.0, "top_k": 5.0,
                                                    "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 8
    assert all(len(c["logprobs"]["tokens"]) == 4 for c in body["choices"])
    chat = connection.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                         "max_completion_tokens": 2.0, "logprobs": True,
                                                         "top_logprobs": 2.0})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("name,value", [("max_tokens", 16.5), ("n", 2.5), ("seed", 0.1), ("logprobs", 1.5),
                                        ("max_tokens", float("inf")), ("top_k", 2**31), ("top_k", 10**19)])
def test_fractions_and_out_of_range_integers_are_400s(connection, name, value):
    body = {"model": "tiny", "prompt": "The list", "max_tokens": 2, name: value}
    resp = connection.post("/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == name


# ----------------------------------------------------------------------------- up to 16 stop strings


def test_sixteen_stop_strings_and_a_clear_400_past_them(connection):
    kw = {"model": "tiny", "prompt": "Return the", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = connection.post("/v1/completions", json=kw).json()["choices"][0]["text"]
    stop = full[3:6]
    many = [f"zz{i}" for i in range(MAX_STOP - 1)] + [stop]  # as lm-eval sends: every `until` string
    choice = connection.post("/v1/completions", json={**kw, "stop": many}).json()["choices"][0]
    assert choice["text"] == full[: full.find(stop)] and choice["finish_reason"] == "stop"
    resp = connection.post("/v1/completions", json={**kw, "stop": many + ["one more"]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"
    assert f"at most {MAX_STOP}" in resp.json()["error"]["message"] and f"{MAX_STOP + 1} strings" in resp.text


# ------------------------------------------------------------------------------ GET /v1/models/{id}


def test_retrieve_the_served_model(server, client):
    model = client.models.retrieve("tiny")  # what the official client's models.retrieve needs
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "nanoserve"
    assert httpx.get(server.url + "/v1/models/tiny").json() == httpx.get(server.url + "/v1/models").json()["data"][0]
    for other in ("gpt-4o", "HuggingFaceTB/SmolLM2-135M"):  # a slash is part of the id, not another route
        resp = httpx.get(f"{server.url}/v1/models/{other}")
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_not_found"
        assert other in error["message"] and "tiny" in error["message"]


# ---------------------------------------------------------------------------- a 500 (a bug)


def test_a_500_keeps_the_connection_usable(server, connection, monkeypatch):
    from nanoserve.server import handlers

    def broken(state):
        raise RuntimeError("a bug")

    monkeypatch.setattr(handlers, "list_models", broken)
    resp = connection.get("/v1/models")
    assert resp.status_code == 500 and resp.json()["error"] == {
        "message": "internal error: RuntimeError: a bug", "type": "server_error", "param": None, "code": None}
    monkeypatch.undo()
    assert connection.get("/v1/models").status_code == 200  # the same keep-alive connection


def test_routing_errors_come_in_openai_shape(server):
    missing = httpx.get(server.url + "/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert "/v1/engines" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["Allow"] == "POST"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


def test_the_bearer_scheme_in_any_case():
    with ServerThread(api_key="sesame") as s:
        body = {"model": "tiny", "prompt": "The list", "max_tokens": 2}
        for scheme in ("Bearer", "bearer", "BEARER"):
            ok = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": f"{scheme} sesame"})
            assert ok.status_code == 200, (scheme, ok.text)
        for value in ("bearer sesam", "bearer sesame2", "Basic sesame", "sesame", "bearer"):
            resp = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": value})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", value


def test_a_chunked_body_over_the_limit_is_a_413():
    def chunks():  # no Content-Length: the Guard cannot see the size up front
        for _ in range(8):
            yield b" " * 500

    with ServerThread(max_body_bytes=1000) as s:
        resp = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        small = (b'{"model": "tiny", "prompt": "The list", "max_tokens": 2}',)
        fits = httpx.post(s.url + "/v1/completions", content=iter(small), headers={"Content-Type": "application/json"})
        assert fits.status_code == 200


@pytest.mark.slow
def test_a_body_that_stalls_is_a_408():
    import socket
    import time

    with ServerThread(app_kwargs={"body_timeout": 0.5}) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny"')  # 16 bytes of the 100 promised
            start = time.monotonic()
            answer = b""
            while not answer.endswith(b"}}"):  # the error body's end
                answer += sock.recv(4096)
            assert time.monotonic() - start < 5
            while sock.recv(4096):  # and the connection is closed (it cannot be reused), within the socket timeout
                pass
        assert answer.startswith(b"HTTP/1.1 408") and b'"code":"body_timeout"' in answer, answer
        with s.slowed(0.03):  # a slow generation (1.2 s, the body long complete) is not a slow body
            slow = httpx.post(s.url + "/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "The list", "max_tokens": 40, "ignore_eos": True})
        assert slow.status_code == 200 and slow.json()["usage"]["completion_tokens"] == 40


def test_an_idle_keep_alive_connection_closes_after_its_timeout():
    """A client that opens a connection and sends nothing more holds a socket (and, by the
    thousand, the server's file descriptors): it is closed after --keep-alive-timeout."""
    import socket
    import time

    with ServerThread(keep_alive_timeout=0.5) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            start, answer = time.monotonic(), b""
            while chunk := sock.recv(4096):  # the answer, then b"": closed by the server (else a 10 s timeout)
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and time.monotonic() - start < 3, answer  # uvicorn alone: 5 s
