"""Issue 38: sessions. A conversation's KV stays in the engine between its HTTP turns
(nanoserve/server/sessions.py), on a real loopback server."""

import json
import threading
import time

import httpx
import pytest
import torch
from agents_helpers import ModelsServer

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import ServerThread

pytestmark = pytest.mark.exercise("end-of-turn")

ENGINE = dict(model="tiny", device="cpu", dtype=torch.float32, block_size=4, num_blocks=128, max_model_len=256,
              enable_prefix_caching=False)  # off: cached_tokens are the session's reuse alone
FIRST = [{"role": "user", "content": "Tell me about lists"}]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=ENGINE) as s:
        s.store = s.app.state.server.sessions
        s.store.clock = FakeClock()
        yield s


@pytest.fixture(scope="module")
def offline():
    return LLM(**ENGINE)


def chat(server, messages, session=None, header=None, max_tokens=6, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    if session is not None:
        body["session_id"] = session
    headers = {"X-Session-Id": header} if header is not None else {}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def cached(response: httpx.Response) -> int:
    return response.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def turns(server) -> str:
    return httpx.get(server.url + "/metrics").text


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def two_turns(server, session, **kw):
    one = chat(server, FIRST, session, **kw)
    assert one.status_code == 200, one.text
    second = FIRST + [{"role": "assistant", "content": one.json()["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And dictionaries?"}]
    return one, second


def test_turn_two_reuses_turn_ones_kv_and_answers_as_without_a_session(server, offline):
    one, second = two_turns(server, "s-reuse")
    assert cached(one) == 0
    two = chat(server, second, "s-reuse")
    tok = offline.tokenizer
    p1, p2 = tok.apply_chat_template(FIRST), tok.apply_chat_template(second)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    out1 = offline.generate([p1], greedy)[0].token_ids
    assert cached(two) == min(common_prefix(p2, p1 + out1[:-1]), len(p2) - 1) > len(p1) // 2
    assert two.json()["choices"][0]["message"]["content"] == offline.generate([p2], greedy)[0].text
    plain = chat(server, second)  # no session: the same answer, nothing reused
    assert cached(plain) == 0 and plain.json()["choices"][0]["message"] == two.json()["choices"][0]["message"]
    assert 'nanoserve:session_turns_total{outcome="resumed",reason=""}' in turns(server)


def test_the_header_names_a_session_and_must_agree_with_the_body(server):
    one, second = two_turns(server, None, header="s-header")
    assert cached(chat(server, second, header="s-header")) > 0
    bad = chat(server, FIRST, "a", header="b")
    assert bad.status_code == 400 and "different sessions" in bad.json()["error"]["message"]
    assert chat(server, FIRST, "x" * 129).status_code == 400
    assert chat(server, FIRST, "s-n", n=2).status_code == 400


def test_streaming_turns_resume_and_report_cached_tokens(server):
    one, second = two_turns(server, "s-stream")
    body = {"model": "tiny", "messages": second, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": "s-stream"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    usage = json.loads(lines[-1])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_expired_session_reprefills_and_metrics_say_why(server):
    one, second = two_turns(server, "s-ttl")
    server.store.clock.now += server.store.ttl + 1
    two = chat(server, second, "s-ttl")
    assert two.status_code == 200 and cached(two) == 0
    assert 'nanoserve:session_turns_total{outcome="reprefilled",reason="expired"} 1.0' in turns(server)


def test_the_cap_releases_the_sessions_idle_longest(server):
    """A cap of one session's blocks: when s-cap-b's turn ends, every session idle longer (the other
    tests' and s-cap-a) is released, and s-cap-a's next turn prefills again."""
    engine = server.async_engine
    before = engine.held_kv()["blocks"]
    server.store.clock.now += 1
    one, second = two_turns(server, "s-cap-a")
    blocks = engine.held_kv()["blocks"] - before
    server.store.kv_fraction = blocks / engine.kv_blocks()[1]
    try:
        server.store.clock.now += 1
        assert chat(server, FIRST, "s-cap-b").status_code == 200  # the same answer: as many blocks as s-cap-a
        deadline = time.monotonic() + 5
        while engine.held_kv()["blocks"] > blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.held_kv()["blocks"] == blocks  # s-cap-b's alone
        two = chat(server, second, "s-cap-a")
        assert two.status_code == 200 and cached(two) == 0
        assert 'nanoserve:session_turns_total{outcome="reprefilled",reason="evicted"} 1.0' in turns(server)
        assert 'nanoserve:session_releases_total{reason="cap"}' in turns(server)
    finally:
        server.store.kv_fraction = 0.5


def test_a_second_turn_while_one_runs_is_a_409(server):
    results = {}
    with server.slowed(0.05):
        runner = threading.Thread(target=lambda: results.setdefault("one", chat(server, FIRST, "s-busy", max_tokens=20)))
        runner.start()
        time.sleep(0.3)
        busy = chat(server, FIRST, "s-busy")
        runner.join()
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
    assert results["one"].status_code == 200
    assert chat(server, FIRST, "s-busy").status_code == 200  # free again


def test_a_cancelled_turn_gives_its_kv_back_and_the_next_turn_reprefills(server):
    one, second = two_turns(server, "s-abort")
    held = server.async_engine.held_kv()["blocks"]
    body = {"model": "tiny", "messages": second, "max_tokens": 60, "temperature": 0, "stream": True,
            "session_id": "s-abort"}
    with server.slowed(0.05):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # the turn runs (it took turn one's KV): the client goes away
    deadline = time.monotonic() + 5
    while server.async_engine.num_pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.async_engine.held_kv()["blocks"] < held  # turn one's KV went with the aborted turn
    three = chat(server, second, "s-abort")
    assert three.status_code == 200 and cached(three) == 0
    assert 'nanoserve:session_turns_total{outcome="reprefilled",reason="aborted"} 1.0' in turns(server)


def test_nothing_is_left_pinned_once_the_sessions_go(server):
    """Last in the module: every session released (a cap of 0), every block free again."""
    engine = server.async_engine
    server.store.kv_fraction = 0.0
    try:
        assert chat(server, FIRST, "s-last").status_code == 200  # its end applies the cap to everyone
        deadline = time.monotonic() + 5
        while engine.held_kv()["blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        free, total = engine.kv_blocks()
        assert engine.held_kv()["blocks"] == 0 and free == total
        assert "nanoserve:session_pinned_blocks 0.0" in turns(server)
    finally:
        server.store.kv_fraction = 0.5


def test_an_unloaded_model_starts_its_sessions_over(other_model):
    with ModelsServer({"tiny": "tiny", "other": other_model}) as s:
        body = {"model": "other", "messages": FIRST, "max_tokens": 4, "temperature": 0, "session_id": "s-unload"}
        one = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        second = FIRST + [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "More"}]
        assert httpx.post(s.url + "/v1/models/other/unload", json={}, timeout=60).status_code == 200
        two = httpx.post(s.url + "/v1/chat/completions", json=body | {"messages": second}, timeout=60)
        assert two.status_code == 200 and "prompt_tokens_details" not in two.json()["usage"]
        metrics = httpx.get(s.url + "/metrics").text
        assert 'nanoserve:session_turns_total{outcome="reprefilled",reason="unloaded"} 1.0' in metrics
