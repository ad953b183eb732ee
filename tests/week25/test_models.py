"""Issue 38: several models in one server. Requests route by `model`; `--max-loaded-models` keeps
at most K resident and unloads the least recently used; a request for an unloaded model waits for
its load (shared with the others that wait, and counted in its TTFT); operators load and unload
models; an unloaded model leaves nothing behind (no engine thread, no engine object)."""

import concurrent.futures
import gc
import threading
import time
import weakref

import httpx
import pytest
from agents_helpers import ENGINE, ModelsServer

from nanoserve.cli import build_parser, main
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.server.models import parse_models
from nanoserve.server.serve import split_models
from nanoserve.testing import AppThread, free_ports

PROMPT = "The list of"


def complete(url: str, model: str, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                                "temperature": 0, **extra})


def operator(url: str, model: str, action: str, **headers) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/{model}/{action}", json={}, timeout=60, headers=headers)


def loaded(url: str) -> dict[str, bool]:
    return {card["id"]: card["loaded"] for card in httpx.get(url + "/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def expected(other_model):
    """Each model's greedy completion of PROMPT, offline."""
    answers = {}
    for name, path in (("tiny", "tiny"), ("other", other_model)):
        llm = LLM(path, **ENGINE)
        answers[name] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].text
    assert answers["tiny"] != answers["other"], "the two models must answer differently for routing to show"
    return answers


@pytest.fixture(scope="module")
def two(other_model):
    with ModelsServer({"tiny": "tiny", "other": other_model}) as server:
        yield server


def test_two_models_served_at_once_each_request_routed_by_its_model(two, expected):
    cards = httpx.get(two.url + "/v1/models").json()["data"]
    assert [(c["id"], c["loaded"], c["max_model_len"]) for c in cards] == [("tiny", True, 256), ("other", True, 256)]
    assert httpx.get(two.url + "/v1/models/other").json()["id"] == "other"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        names = ["tiny", "other"] * 4
        answers = list(pool.map(lambda name: complete(two.url, name), names))
    for name, answer in zip(names, answers):
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name and answer.json()["choices"][0]["text"] == expected[name]
    chat = httpx.post(two.url + "/v1/chat/completions", json={"model": "other", "max_tokens": 3,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "other"
    assert two.engine_threads() >= {"nanoserve-engine tiny", "nanoserve-engine other"}
    health = httpx.get(two.url + "/health").json()
    assert health["models"] == {"tiny": "loaded", "other": "loaded"} and health["kv_blocks_total"] == 128


def test_an_unknown_model_is_the_usual_404(two):
    answer = complete(two.url, "gpt-4o")
    assert answer.status_code == 404
    assert answer.json()["error"] == {"message": "the model 'gpt-4o' does not exist; this server serves 'tiny', 'other'",
                                      "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert operator(two.url, "gpt-4o", "load").status_code == 404
    assert httpx.get(two.url + "/v1/models/gpt-4o").status_code == 404


def test_metrics_label_each_models_engine(two):
    text = httpx.get(two.url + "/metrics").text
    assert 'nanoserve:kv_blocks_total{model="tiny"} 64.0' in text and 'nanoserve:kv_blocks_total{model="other"} 64.0' in text
    assert 'nanoserve:model_loaded{model="other"} 1.0' in text


@pytest.mark.exercise("load-model")
def test_lru_eviction_keeps_one_model_and_reloads_on_demand(other_model, expected):
    with ModelsServer({"tiny": "tiny", "other": other_model}, max_loaded=1, load_delay=0.3, log_requests=True) as s:
        assert loaded(s.url) == {"tiny": True, "other": False}
        assert s.engine_threads() == {"nanoserve-engine tiny"}
        records = []
        s.registry.add_listener(lambda output, options: records.append(output.metrics))
        assert complete(s.url, "other").json()["choices"][0]["text"] == expected["other"]  # loads other, evicts tiny
        assert loaded(s.url) == {"tiny": False, "other": True}
        assert s.engine_threads() == {"nanoserve-engine other"}
        assert complete(s.url, "tiny").json()["choices"][0]["text"] == expected["tiny"]  # and back
        assert s.builds == {"tiny": 2, "other": 1}
        # the load (at least load_delay) is part of the request's TTFT: it counts from the request's arrival
        ttft = records[-1].token_times[0] - records[-1].arrival_time
        assert ttft >= 0.3, ttft
        metrics = httpx.get(s.url + "/metrics").text
        assert 'nanoserve:model_unloads_total{model="tiny",reason="lru"} 1.0' in metrics
        assert 'nanoserve:model_loads_total{model="tiny"} 2.0' in metrics


@pytest.mark.exercise("load-model")
def test_requests_waiting_for_one_model_share_its_load(other_model, expected):
    with ModelsServer({"tiny": "tiny", "other": other_model}, max_loaded=1, load_delay=0.3) as s:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: complete(s.url, "other"), range(6)))
        assert [a.json()["choices"][0]["text"] for a in answers] == [expected["other"]] * 6
        assert s.builds["other"] == 1


@pytest.mark.exercise("load-model")
def test_alternating_models_with_one_slot_all_answer_right(other_model, expected):
    """K = 1 and requests for both models at once: each eviction waits for the evicted model's
    requests in flight to finish (drain), and every answer is the right model's."""
    with ModelsServer({"tiny": "tiny", "other": other_model}, max_loaded=1) as s:
        names = ["tiny", "other", "other", "tiny", "other", "tiny"] * 2
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda name: complete(s.url, name), names))
        for name, answer in zip(names, answers):
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected[name]
        assert s.registry.resident() == 1 and len(s.engine_threads()) == 1


@pytest.mark.exercise("load-model")
def test_unload_and_reload_under_load(other_model, expected):
    """Requests stream to tiny without pause while an operator unloads and reloads other, and
    requests for other come in between: every request answers, with its own model's text."""
    with ModelsServer({"tiny": "tiny", "other": other_model}) as s:
        stop, failures, served = threading.Event(), [], []

        def load_on_tiny():
            while not stop.is_set():
                answer = complete(s.url, "tiny", stream=True)
                text = "".join(line for line in answer.text.splitlines() if line.startswith("data: {"))
                (served if answer.status_code == 200 and text else failures).append(answer.status_code)

        workers = [threading.Thread(target=load_on_tiny) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            for _ in range(3):
                assert operator(s.url, "other", "unload").json() == {"object": "model", "id": "other", "loaded": False}
                assert loaded(s.url)["other"] is False
                assert complete(s.url, "other").json()["choices"][0]["text"] == expected["other"]  # loaded on demand
                assert operator(s.url, "other", "unload").status_code == 200
                assert operator(s.url, "other", "load").json()["loaded"] is True
        finally:
            stop.set()
            for w in workers:
                w.join()
        assert not failures and served
        assert s.builds["other"] == 7


def test_nothing_is_left_of_an_unloaded_model(other_model):
    with ModelsServer({"tiny": "tiny", "other": other_model}) as s:
        served = s.registry.slots["other"].served
        engine, async_engine = weakref.ref(served.engine.engine), weakref.ref(served.engine)
        weights = weakref.ref(next(served.engine.engine.model.parameters()))
        kv_pool = weakref.ref(served.engine.engine.runner.cache.k)
        del served
        assert operator(s.url, "other", "unload").status_code == 200
        gc.collect()
        assert engine() is None and async_engine() is None and weights() is None and kv_pool() is None
        assert s.engine_threads() == {"nanoserve-engine tiny"}
        assert complete(s.url, "tiny").status_code == 200  # the other model serves on
        assert operator(s.url, "other", "unload").json()["loaded"] is False  # already unloaded: nothing to do


def test_an_unload_with_requests_in_flight_is_refused(other_model):
    with ModelsServer({"tiny": "tiny", "other": other_model}, step_delay=0.02) as s:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"model": "other", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
                                "stream": True}) as stream:
            lines = stream.iter_lines()  # (kept: a line iterator dropped closes the connection)
            next(lines)  # the first chunk: the request is in flight
            refused = operator(s.url, "other", "unload")
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_busy"
        deadline = time.time() + 10
        while s.registry.slots["other"].busy and time.time() < deadline:
            time.sleep(0.02)
        assert operator(s.url, "other", "unload").status_code == 200


@pytest.mark.exercise("load-model")
def test_operator_endpoints_are_behind_the_api_key(other_model):
    app = "https://ops.example"
    with ModelsServer({"tiny": "tiny", "other": other_model}, api_key=["k1", "k2"], allowed_origins=[app]) as s:
        # a browser's preflight (CORS, --allowed-origins) is answered without the key; the request itself needs it
        preflight = {"Origin": app, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        answer = httpx.options(s.url + "/v1/models/other/unload", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == app
        elsewhere = httpx.options(s.url + "/v1/models/other/unload", headers={**preflight, "Origin": "https://evil.example"})
        assert elsewhere.status_code == 400 and "access-control-allow-origin" not in elsewhere.headers
        assert operator(s.url, "other", "unload").status_code == 401
        assert operator(s.url, "other", "unload", Authorization="Bearer wrong").status_code == 401
        assert operator(s.url, "other", "unload", Authorization="Bearer k2").status_code == 200
        assert operator(s.url, "other", "load", Authorization="Bearer k1").json()["loaded"] is True
        # a POST without a JSON body is refused as any other (a web page cannot send one unasked)
        bare = httpx.post(s.url + "/v1/models/other/unload", headers={"Authorization": "Bearer k1"})
        assert bare.status_code == 415


def test_the_command_line_names_the_models(other_model):
    def args(*argv):
        parsed = build_parser().parse_args(["serve", *argv])
        split_models(parsed)
        return parsed

    plain = args("--model", "tiny")  # as before issue 38: one model, named by its path
    assert plain.models == {"tiny": "tiny"} and plain.model == "tiny"
    assert args("--model", "tiny", "--served-model-name", "t").models == {"t": "tiny"}
    assert args().models == {"tiny": "tiny"}
    several = args("--model", "a=tiny", "--model", f"b={other_model}", "--max-loaded-models", "1")
    assert several.models == {"a": "tiny", "b": other_model} and several.max_loaded_models == 1
    for argv, message in [(["--model", "a=tiny", "--model", "a=tiny"], "names 'a' twice"),
                          (["--model", "a=tiny", "--model", "tiny"], "takes NAME=PATH"),
                          (["--model", "a=tiny", "--model", "b=tiny", "-tp", "2"], "--tensor-parallel-size"),
                          (["--model", "a=tiny", "--model", "b=tiny", "--lora-modules", "x=/y"], "--lora-modules"),
                          (["--model", "a=tiny", "--model", "b=tiny", "--served-model-name", "c"], "--served-model-name"),
                          (["--max-loaded-models", "0"], "at least 1")]:
        with pytest.raises(ValueError, match=message):
            args(*argv)
    assert parse_models(["x=y"]) == {"x": "y"}


@pytest.mark.exercise("load-model", "token-bucket")
def test_nanoserve_serve_with_two_models(other_model, expected, monkeypatch, capsys):
    """`nanoserve serve` with two models, one resident: its app, served as uvicorn.run would serve it
    (in this process), loads the other for a request; every engine is shut down when it returns."""
    seen = {}

    def run(app, **options):
        with AppThread(app) as s:
            seen["before"] = loaded(s.url)
            seen["text"] = complete(s.url, "other").json()["choices"][0]["text"]
            seen["after"] = loaded(s.url)
            seen["registry"] = app.state.server.models

    monkeypatch.setattr("nanoserve.server.serve.uvicorn.run", run)
    assert main(["serve", "--model", "tiny=tiny", "--model", f"other={other_model}", "--max-loaded-models", "1",
                 "--device", "cpu", "--num-blocks", "64", "--max-model-len", "256", "--port", str(free_ports(1)),
                 "--rate-limit-rpm", "100"]) == 0
    assert seen["before"] == {"tiny": True, "other": False} and seen["after"] == {"tiny": False, "other": True}
    assert seen["text"] == expected["other"]
    assert seen["registry"].resident() == 0  # shut down on the way out
    err = capsys.readouterr().err
    assert "nanoserve: serving tiny (tiny) on" in err and "nanoserve: other" in err and "loads on its first request" in err
