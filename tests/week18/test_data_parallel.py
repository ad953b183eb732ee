"""Week 18: replicas behind one front (data parallelism), and a tensor-parallel server that fails loudly."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
import torch

from nanoserve.server.data_parallel import (
    Replica,
    Router,
    create_front,
    estimate_tokens,
    replica_argv,
    wait_healthy,
)
from nanoserve.testing import free_ports, ServerThread, dead_url


@pytest.mark.exercise("route")
def test_the_router_picks_the_fewest_outstanding_tokens():
    router = Router([Replica("a"), Replica("b"), Replica("c")])
    long = router.pick(4000)  # a long document goes to one replica...
    short = [router.pick(10) for _ in range(6)]  # ...and the next short ones avoid it
    assert long not in short and {r.url for r in short} == {"b", "c"}
    assert [r.outstanding for r in router.replicas] == [4000, 30, 30]
    router.done(long, 4000)
    assert router.pick(10) is long  # free again: the least loaded
    assert long.in_flight == 1 and long.sent == 2


@pytest.mark.exercise("route")
def test_ties_are_taken_in_turn_and_unhealthy_replicas_skipped():
    router = Router([Replica("a"), Replica("b")])
    first = router.pick(1)
    router.done(first, 1)
    second = router.pick(1)
    assert second is not first
    router.done(second, 1)
    router.replicas[0].healthy = False
    assert {router.pick(1).url for _ in range(3)} == {"b"}
    router.replicas[1].healthy = False
    with pytest.raises(LookupError):
        router.pick(1)


def test_a_request_is_counted_by_its_tokens():
    words = lambda text: len(text.split())  # noqa: E731
    assert estimate_tokens({"prompt": "one two three", "max_tokens": 5}, words) == 8
    assert estimate_tokens({"prompt": ["a b", "c"], "max_tokens": 2, "n": 3}, words) == ((2 + 2) + (1 + 2)) * 3
    assert estimate_tokens({"prompt": [5, 6, 7, 8]}, words) == 4 + 16  # token ids; max_tokens' default
    chat = {"messages": [{"role": "user", "content": "hi there"},
                         {"role": "user", "content": [{"type": "text", "text": "and you"}]}],
            "max_completion_tokens": 10}
    assert estimate_tokens(chat, words) == 4 + 10


def test_replicas_get_the_front_options_but_their_own_address():
    argv = ["serve", "--model", "tiny", "--port", "9000", "--data-parallel-size=2", "--host", "0.0.0.0", "-tp", "2"]
    assert replica_argv(argv) == ["serve", "--model", "tiny", "-tp", "2"]


@pytest.fixture(scope="module")
def replicas():
    with ServerThread(engine_kwargs=dict(dtype=torch.float32)) as a, \
            ServerThread(engine_kwargs=dict(dtype=torch.float32)) as b:
        yield [a, b]


@pytest.fixture
def front(replicas):
    import uvicorn

    app = create_front([r.url for r in replicas] + [dead_url()])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app.state.router
    server.should_exit = True
    thread.join(10)


BODY = dict(model="tiny", prompt="The list", max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.exercise("front")
def test_the_front_spreads_requests_and_answers_like_one_replica(front, replicas):
    url, router = front
    direct = httpx.post(replicas[0].url + "/v1/completions", json=BODY, timeout=60).json()
    with httpx.Client(timeout=60) as client:
        answers = [client.post(url + "/v1/completions", json=BODY) for _ in range(6)]
    assert all(r.status_code == 200 for r in answers)
    assert {r.json()["choices"][0]["text"] for r in answers} == {direct["choices"][0]["text"]}
    served = {r.headers["x-nanoserve-replica"] for r in answers}
    assert served == {"0", "1"}  # both live replicas; the dead one (2) was taken out
    assert not router.replicas[2].healthy and router.replicas[2].error
    assert [r.outstanding for r in router.replicas] == [0, 0, 0]  # every request finished and was counted out


@pytest.mark.exercise("front")
def test_streams_pass_through_and_health_reports_each_replica(front):
    url, router = front
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 8 + 2  # a chunk per token, the final one, [DONE]
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert [s["healthy"] for s in health.json()["replicas"]] == [True, True, False]
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    assert httpx.get(url + "/v1/models/tiny", timeout=30).json()["id"] == "tiny"  # issue 30
    assert httpx.get(url + "/v1/models/org/other", timeout=30).json()["error"]["code"] == "model_not_found"
    bad = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]  # the replica's own answer


@pytest.mark.slow


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"])
def test_serve_with_two_replicas_from_the_command_line(stop):
    """Two replicas behind the front; Ctrl-C and SIGTERM (what docker, systemd and kubernetes send)
    each end the front and both replicas within 10 s. A front killed outright (SIGKILL, the OOM
    killer) runs no code at all: on Linux the kernel ends the replicas (`end_with_parent`)."""
    if stop == signal.SIGKILL and sys.platform != "linux":
        pytest.skip("only Linux can tie a child's life to its parent's (prctl PR_SET_PDEATHSIG)")
    psutil = pytest.importorskip("psutil", reason="the test finds the replicas' processes with psutil: pip install psutil")
    port = free_ports(3)  # the front, and its replicas on the next two
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "tiny", "--device", "cpu", "--port", str(port),
           "--data-parallel-size", "2", "--log-level", "warning"]
    # Output to a file, not a pipe: leaked replicas would hold a pipe open and block a read of it.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    replicas = []
    try:
        wait_healthy([url], [proc], timeout=120)
        replicas = psutil.Process(proc.pid).children()
        assert len(replicas) == 2
        assert all(httpx.get(f"http://127.0.0.1:{port + i}/health").status_code == 200 for i in (1, 2))
        served = {httpx.post(url + "/v1/completions", json=BODY, timeout=60).headers["x-nanoserve-replica"]
                  for _ in range(4)}
        assert served == {"0", "1"}
        started = time.monotonic()
        proc.send_signal(stop)
        code = proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(replicas, timeout=max(0.1, 10 - (time.monotonic() - started)))
        assert not alive, f"replicas still running {time.monotonic() - started:.1f} s after the front's {stop.name}"
        assert code == (-signal.SIGKILL if stop == signal.SIGKILL else 0) and time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in replicas:
            if p.is_running():
                p.kill()
    for i in (1, 2):  # the replicas went with it
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port + i}/health", timeout=2)


@pytest.mark.slow
def test_a_tensor_parallel_server_answers_503_once_a_rank_is_gone():
    kwargs = dict(dtype=torch.float32, tensor_parallel_size=2)
    with ServerThread(engine_kwargs=kwargs) as server:
        assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
        os.kill(server.engine.workers.procs[0].pid, signal.SIGKILL)
        time.sleep(0.5)
        failed = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)
        assert failed.status_code in (500, 503) and "rank 1" in failed.json()["error"]["message"]
        again = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_failed"
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]


@pytest.mark.slow
def test_offline_replicas_give_the_same_outputs_in_order():
    from nanoserve.server.data_parallel import generate_data_parallel
    from nanoserve.engine.engine import LLM
    from nanoserve.engine.config import EngineConfig
    from nanoserve.sampling.params import SamplingParams

    config = EngineConfig(model="tiny", device="cpu", dtype=torch.float32)
    prompts = ["The list", "A dictionary is", "Once upon a time", "def f(x):", "Paris is"]
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    one = LLM(config).generate(prompts, params)
    two, seconds = generate_data_parallel(config, prompts, params, 2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one] and seconds > 0
    assert [o.text for o in two] == [o.text for o in one]
