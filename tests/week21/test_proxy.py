"""Issue 35 over HTTP: a prefill server and a decode server (`--role`), and the proxy in front.

Answers through the proxy equal one server's, plain and streamed (SSE), completions and chat; a
client that leaves mid-stream aborts the request on the decode instance; requests the pair cannot
split run whole on the decode instance; a transfer that cannot land is a 504 (late) or a 502
(lost), a prefill instance that is gone a 502 from the proxy, which goes on serving. Every KV
block is free on both instances after each test.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import torch

from nanoserve.server.data_parallel import wait_healthy
from nanoserve.server.disaggregated import create_proxy
from nanoserve.testing import AppThread, ServerThread, free_ports

BODY = dict(model="tiny", prompt="The list of", max_tokens=10, temperature=0, ignore_eos=True)
CHAT = dict(model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=10, temperature=0)


def role_server(role: str, address: str, **kwargs) -> ServerThread:
    return ServerThread(engine_kwargs=dict(dtype=torch.float32, kv_role=role, kv_address=address, **kwargs))


@pytest.fixture(scope="module")
def colocated():
    with ServerThread(engine_kwargs=dict(dtype=torch.float32)) as server:
        yield server


@pytest.fixture(scope="module")
def pair():
    address = f"127.0.0.1:{free_ports(1)}"
    with role_server("decode", address) as decode, role_server("prefill", address) as prefill, \
            AppThread(create_proxy(prefill.url, decode.url)) as proxy:
        yield prefill, decode, proxy


def assert_idle(*servers: ServerThread) -> None:
    for server in servers:
        assert server.wait_idle(), f"{server.url} still holds KV blocks or requests"
        assert server.engine.scheduler.allocator.num_used == 0 and not server.engine.scheduler.kept


@pytest.mark.exercise("proxy-route", "send-blocks", "land-transfers", "admit-computed")
def test_answers_through_the_proxy_equal_one_servers(pair, colocated):
    prefill, decode, proxy = pair
    for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
        expected = httpx.post(colocated.url + path, json=body, timeout=60).json()
        got = httpx.post(proxy.url + path, json=body, timeout=60)
        assert got.status_code == 200, got.text
        answer = got.json()
        assert answer["choices"] == expected["choices"] and answer["usage"] == expected["usage"]
    assert proxy.app.state.counts["split"] == 2
    stats = decode.async_engine.stats()["kv_transfer"]
    assert stats["received"] >= 2 and stats["bytes_received"] > 0 and stats["failed"] == 0
    metrics = httpx.get(decode.url + "/metrics", timeout=30).text
    assert 'nanoserve:kv_transfers_total{direction="received"}' in metrics
    assert "nanoserve:kv_transfer_seconds_total" in metrics
    sent = httpx.get(prefill.url + "/metrics", timeout=30).text
    bytes_sent = prefill.async_engine.stats()["kv_transfer"]["bytes_sent"]
    assert bytes_sent >= stats["bytes_received"]  # (equal, unless a transfer was cancelled on its way)
    assert f'nanoserve:kv_transfer_bytes_total{{direction="sent"}} {float(bytes_sent)}' in sent
    assert_idle(prefill, decode)


def sse_texts(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):])["choices"][0]["text"] for line in lines[:-1]]


@pytest.mark.exercise("proxy-route")
def test_streams_pass_through_the_proxy_token_by_token(pair, colocated):
    prefill, decode, proxy = pair
    expected = sse_texts(colocated.url, BODY)
    got = sse_texts(proxy.url, BODY)
    assert got == expected and len(got) == BODY["max_tokens"] + 1  # a chunk per token (the first one's included), the last
    assert_idle(prefill, decode)


@pytest.mark.exercise("proxy-route")
def test_a_client_that_leaves_mid_stream_aborts_the_request_on_the_decode_instance(pair):
    prefill, decode, proxy = pair
    with decode.slowed(0.1):
        with httpx.stream("POST", proxy.url + "/v1/completions",
                          json={**BODY, "max_tokens": 200, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then the client goes away
            assert len(decode.engine.scheduler.running) == 1
        # 200 tokens at 0.1 s a step would take 20 s: idle within assert_idle's 10 s means aborted
        assert_idle(prefill, decode)


@pytest.mark.exercise("proxy-route")
def test_concurrent_streams_through_a_small_decode_pool_are_preempted_and_still_right(colocated):
    address = f"127.0.0.1:{free_ports(1)}"
    prompts = ["The list of", "A dictionary is", "Once upon a time", "def f(x):"]
    body = {**BODY, "max_tokens": 30}
    expected = [sse_texts(colocated.url, {**body, "prompt": p}) for p in prompts]
    with role_server("decode", address, block_size=4, num_blocks=16) as decode, \
            role_server("prefill", address, block_size=4) as prefill, \
            AppThread(create_proxy(prefill.url, decode.url)) as proxy:
        with decode.slowed(0.01), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: sse_texts(proxy.url, {**body, "prompt": p}), prompts))
        assert decode.engine.scheduler.num_preemptions > 0  # 4 x 9 blocks wanted, 16 in the pool
        assert got == expected
        assert_idle(prefill, decode)


@pytest.mark.exercise("proxy-route")
def test_requests_the_pair_cannot_split_run_whole_on_the_decode_instance(pair, colocated):
    prefill, decode, proxy = pair
    before = dict(proxy.app.state.counts)
    for body in ({**BODY, "n": 2, "temperature": 0.8, "seed": 1}, {**BODY, "echo": True}, {**BODY, "logprobs": 0},
                 {**BODY, "max_tokens": 1}, {**BODY, "prompt": ["a b", "c d"]}):
        got = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        expected = httpx.post(colocated.url + "/v1/completions", json=body, timeout=60).json()
        assert got.json()["choices"] == expected["choices"]
    chat = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["choices"][0]["logprobs"] is not None
    assert proxy.app.state.counts["whole"] == before["whole"] + 6 and proxy.app.state.counts["split"] == before["split"]
    bad = httpx.post(proxy.url + "/v1/completions", json={**BODY, "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]  # the prefill instance's answer
    assert_idle(prefill, decode)


@pytest.mark.exercise("proxy-route")
def test_a_transfer_that_cannot_land_is_a_502_or_a_504_and_frees_the_blocks(pair):
    prefill, decode, proxy = pair
    lost = {**BODY, "kv_transfer_params": dict(transfer_id="nobody-sent-this", prompt_token_ids=[1, 2, 3],
                                               first_token=4)}
    r = httpx.post(decode.url + "/v1/completions", json=lost, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed"
    assert "holds no KV under this id" in r.json()["error"]["message"]
    with role_server("decode", f"127.0.0.1:{free_ports(1)}", kv_transfer_timeout=0.5) as alone:  # no prefill instance
        r = httpx.post(alone.url + "/v1/completions", json={**lost, "stream": True}, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "kv_transfer_timeout"
        assert "did not land within 0.5 s" in r.json()["error"]["message"]
        with AppThread(create_proxy(prefill.url, alone.url)) as proxy_to_alone:  # the proxy relays it as it is
            r = httpx.post(proxy_to_alone.url + "/v1/completions", json={**BODY, "stream": True}, timeout=60)
            assert r.status_code == 504 and r.json()["error"]["code"] == "kv_transfer_timeout"
        assert_idle(alone)
    assert_idle(prefill, decode)


def test_role_mistakes_are_400s(pair, colocated):
    prefill, decode, proxy = pair
    r = httpx.post(colocated.url + "/v1/completions", json={**BODY, "kv_transfer_params": {"send": True}}, timeout=30)
    assert r.status_code == 400 and "without --role" in r.json()["error"]["message"]
    r = httpx.post(prefill.url + "/v1/completions", json={**BODY, "stream": True, "kv_transfer_params": {"send": True}},
                   timeout=30)
    assert r.status_code == 400 and "'stream': false" in r.json()["error"]["message"]
    r = httpx.post(prefill.url + "/v1/completions", json={**BODY, "kv_transfer_params": {"send": True}}, timeout=30)
    assert r.status_code == 400 and "max_tokens must be 1" in r.json()["error"]["message"]
    r = httpx.post(decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": {"id": 1}}, timeout=30)
    assert r.status_code == 400 and "'transfer_id'" in r.json()["error"]["message"]
    bad_token = dict(transfer_id="x", prompt_token_ids=[1, 10**6], first_token=4)
    r = httpx.post(decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": bad_token}, timeout=30)
    assert r.status_code == 400 and "token ids, in [0, " in r.json()["error"]["message"]
    assert_idle(prefill, decode)


@pytest.mark.exercise("proxy-route")
def test_an_instance_is_healthy_only_once_the_pair_has_joined():
    """A decode instance alone answers /health 503 (its connector has no session); once a prefill
    instance has joined it, both answer 200: a proxy never routes into a pair that cannot move KV."""
    address = f"127.0.0.1:{free_ports(1)}"
    with role_server("decode", address) as decode:
        health = httpx.get(decode.url + "/health", timeout=30)
        assert health.status_code == 503 and "no session" in health.json()["error"]
        with role_server("prefill", address) as prefill:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                    httpx.get(s.url + "/health", timeout=30).status_code == 200 for s in (decode, prefill)):
                time.sleep(0.1)
            assert httpx.get(decode.url + "/health", timeout=30).status_code == 200
            assert httpx.get(prefill.url + "/health", timeout=30).status_code == 200


def test_a_prefill_instance_that_is_gone_is_a_502_and_the_proxy_goes_on():
    address = f"127.0.0.1:{free_ports(1)}"
    with role_server("decode", address) as decode:
        with role_server("prefill", address) as prefill:
            proxy_app = create_proxy(prefill.url, decode.url)
            with AppThread(proxy_app) as proxy:
                assert httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
                assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200
            prefill_url = prefill.url
        # the prefill server has stopped
        with AppThread(create_proxy(prefill_url, decode.url)) as proxy:
            r = httpx.post(proxy.url + "/v1/completions", json=BODY, timeout=60)
            assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_unavailable"
            assert prefill_url in r.json()["error"]["message"]
            health = httpx.get(proxy.url + "/health", timeout=30)
            assert health.status_code == 503 and not health.json()["prefill"]["healthy"]
            assert health.json()["decode"]["healthy"]
            one = httpx.post(proxy.url + "/v1/completions", json={**BODY, "max_tokens": 1}, timeout=60)
            assert one.status_code == 200  # what runs whole on the decode instance is still served
            assert httpx.get(proxy.url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
        assert_idle(decode)


@pytest.mark.exercise("proxy-route")
@pytest.mark.slow
def test_serve_disaggregated_from_the_command_line_and_a_killed_prefill_instance_replaced():
    """`nanoserve serve --disaggregated`: the pair and the proxy, as a user starts them. The prefill
    instance is then killed outright: the proxy answers 502 and stays up, the decode instance holds
    no block; a new prefill instance started by hand takes its place; Ctrl-C ends the proxy and the
    decode instance."""
    psutil = pytest.importorskip("psutil", reason="the test finds the instances' processes with psutil: pip install psutil")
    port, kv_port = free_ports(3), free_ports(1)
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
           "--disaggregated", "--kv-address", f"127.0.0.1:{kv_port}", "--log-level", "warning"]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url, children = f"http://127.0.0.1:{port}", []
    try:
        wait_healthy([url], [proc], timeout=120)
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
        assert httpx.get(url + "/health", timeout=30).json()["requests"]["split"] == 1
        prefill = [c for c in children if "prefill" in c.cmdline()]
        prefill_cmd = prefill[0].cmdline()
        prefill[0].kill()  # (a zombie until the launcher reaps it, at its own end)
        deadline = time.monotonic() + 10
        while prefill[0].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_unavailable"
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["decode"]["kv_blocks_free"] == \
            health.json()["decode"]["kv_blocks_total"]
        # a new prefill instance in its place: the decode instance joins it, the proxy splits again
        again = subprocess.Popen(prefill_cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy([f"http://127.0.0.1:{port + 1}"], [again], timeout=120)
            deadline = time.monotonic() + 120
            while httpx.get(url + "/health", timeout=30).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            # 200 only once the re-formed pair has joined its new session: the first request is served
            r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
            log.seek(0)
            assert r.status_code == 200, (r.text, log.read()[-3000:])
            assert httpx.get(url + "/health", timeout=30).json()["requests"]["split"] >= 2
        finally:
            again.kill()
            again.wait(timeout=10)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:
            if c.is_running():
                c.kill()
        log.seek(0)
        print(log.read()[-3000:])
