"""Week 16: `/metrics` scraped with prometheus_client's own parser after a known sequence of
requests (answers, errors, an abort), the request log, and `priority` over HTTP."""

import json
import logging
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.engine.engine import Engine
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import ServerThread


def scrape(url: str) -> dict:
    """{(sample name, frozenset of labels): value} from the server's /metrics."""
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    with ServerThread(engine_kwargs=dict(max_model_len=256, num_blocks=256)) as s:
        yield s


@pytest.mark.exercise("observe-request")
def test_counts_and_histograms_after_a_known_sequence_of_requests(server):
    url, before = server.url, scrape(server.url)
    assert value(before, "nanoserve:kv_blocks_total") == 256
    completions = []
    for i, max_tokens in enumerate([3, 5, 8]):  # finish by length: ignore_eos
        r = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt=f"metrics {i}", max_tokens=max_tokens,
                                                          temperature=0, ignore_eos=True), timeout=60)
        assert r.status_code == 200
        completions.append(r.json())
    chat = httpx.post(url + "/v1/chat/completions", json=dict(model="tiny", max_tokens=4, temperature=0,
                                                             messages=[{"role": "user", "content": "hi"}]), timeout=60)
    assert chat.status_code == 200
    answered = completions + [chat.json()]
    # Errors: a bad field, an unknown model, an unknown path.
    assert httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt="x", temperature=7)).status_code == 400
    assert httpx.post(url + "/v1/completions", json=dict(model="gpt-9", prompt="x")).status_code == 404
    assert httpx.get(url + "/no/such/path").status_code == 404
    # An abort: a stream whose client leaves after the first token.
    with server.slowed(0.05):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json=dict(model="tiny", prompt="abort me", max_tokens=200, ignore_eos=True,
                                    stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # one token seen: hang up
        wait_for(lambda: value(scrape(url), "nanoserve:request_success_total", finished_reason="abort")
                 - value(before, "nanoserve:request_success_total", finished_reason="abort") == 1)
    assert server.wait_idle()
    after = scrape(url)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    reasons = [c["choices"][0]["finish_reason"] for c in answered]
    for reason in ("stop", "length"):
        assert grew("nanoserve:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert grew("nanoserve:request_success_total", finished_reason="abort") == 1
    assert grew("nanoserve:http_requests_total", endpoint="/v1/completions", status="200") == 4  # 3 + the stream
    assert grew("nanoserve:http_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert grew("nanoserve:http_requests_total", endpoint="/v1/completions", status="400") == 1
    assert grew("nanoserve:http_requests_total", endpoint="/v1/completions", status="404") == 1
    assert grew("nanoserve:http_requests_total", endpoint="other", status="404") == 1

    prompt = sum(c["usage"]["prompt_tokens"] for c in answered)
    output = sum(c["usage"]["completion_tokens"] for c in answered)
    # Lengths and end-to-end times: the four requests that ran to their end.
    assert grew("nanoserve:request_prompt_tokens_count") == 4
    assert grew("nanoserve:request_prompt_tokens_sum") == prompt == grew("nanoserve:prompt_tokens_total")
    assert grew("nanoserve:request_generation_tokens_sum") == output
    assert grew("nanoserve:e2e_request_latency_seconds_count") == 4
    # Token latencies: the aborted stream's tokens count too.
    aborted_tokens = grew("nanoserve:generation_tokens_total") - output
    assert aborted_tokens >= 1
    assert grew("nanoserve:time_to_first_token_seconds_count") == 5
    assert grew("nanoserve:inter_token_latency_seconds_count") == output + aborted_tokens - 5
    assert grew("nanoserve:request_queue_time_seconds_count") == 5
    # Histograms are cumulative: the +Inf bucket holds everything, and the buckets never decrease.
    ttft_buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in after.items()
                          if name == "nanoserve:time_to_first_token_seconds_bucket")
    assert ttft_buckets[-1][1] == value(after, "nanoserve:time_to_first_token_seconds_count")
    assert all(a[1] <= b[1] for a, b in zip(ttft_buckets, ttft_buckets[1:]))
    # Idle again: the gauges say so, and the engine's own counters are exported.
    assert value(after, "nanoserve:num_requests_running") == 0 == value(after, "nanoserve:num_requests_waiting")
    assert value(after, "nanoserve:kv_blocks_used") == 0 == value(after, "nanoserve:kv_cache_usage_perc")
    assert value(after, "nanoserve:engine_steps_total") == server.engine.num_steps
    assert value(after, "nanoserve:num_preemptions_total") == server.engine.scheduler.num_preemptions


@pytest.mark.exercise("engine-metrics")
def test_gauges_show_the_load_while_it_runs(server):
    with server.slowed(0.05):
        done = []

        def one(i):
            done.append(httpx.post(server.url + "/v1/completions", timeout=60,
                                   json=dict(model="tiny", prompt=f"load {i}", max_tokens=30, ignore_eos=True)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: value(scrape(server.url), "nanoserve:num_requests_running") == 4)
        during = scrape(server.url)
        for t in threads:
            t.join()
    assert all(r.status_code == 200 for r in done)
    assert value(during, "nanoserve:kv_blocks_used") > 0
    assert value(during, "nanoserve:kv_cache_usage_perc") == value(during, "nanoserve:kv_blocks_used") / 256
    assert value(during, "nanoserve:num_requests_in_flight") == 4


def test_abort_returns_the_final_output_with_its_timeline():
    engine = Engine(EngineConfig(model="tiny", device="cpu"))
    rid = engine.add_request("abort", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 2
    m = out.metrics
    assert m.num_output_tokens == 2 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.arrival_time <= m.first_scheduled_time <= m.token_times[0] <= m.token_times[1] <= m.finished_time
    assert engine.abort(rid) is None  # already gone
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks


def test_request_log_one_json_line_per_finished_request(caplog):
    with ServerThread(app_kwargs=dict(log_requests=True)) as server:
        with caplog.at_level(logging.INFO, logger="nanoserve.requests"):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json=dict(model="tiny", prompt="log me", max_tokens=6, ignore_eos=True)).json()
            assert httpx.post(server.url + "/v1/completions", json=dict(model="tiny", prompt="")).status_code == 400
            wait_for(lambda: len(caplog.records) >= 1)
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "nanoserve.requests"]
    assert len(lines) == 1  # the refused request never reached the engine
    line = lines[0]
    assert line["request_id"] == r["id"]
    assert line["prompt_tokens"] == r["usage"]["prompt_tokens"] and line["output_tokens"] == 6
    assert line["finish_reason"] == "length" and line["preemptions"] == 0 and line["priority"] == 0
    assert 0 <= line["queue_s"] <= line["ttft_s"] <= line["e2e_s"]


def test_request_log_is_off_by_default(server, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve.requests"):
        assert httpx.post(server.url + "/v1/completions", timeout=60,
                          json=dict(model="tiny", prompt="quiet", max_tokens=2)).status_code == 200
        time.sleep(0.2)
    assert not [rec for rec in caplog.records if rec.name == "nanoserve.requests"]


def test_no_metrics_means_no_endpoint():
    with ServerThread(app_kwargs=dict(metrics=False)) as server:
        assert httpx.get(server.url + "/metrics").status_code == 404
        assert server.async_engine.listeners == []


def test_priority_over_http_runs_the_urgent_request_first():
    """One seat: a long request holds it; a low-priority and then an urgent request queue behind
    it; the urgent one, sent last, finishes first."""
    kwargs = dict(max_model_len=256, num_blocks=256, max_num_seqs=1, scheduling_policy="priority")
    with ServerThread(engine_kwargs=kwargs, app_kwargs=dict(log_requests=True)) as server, server.slowed(0.01):
        finished = []

        def send(name, priority, max_tokens):
            body = dict(model="tiny", prompt=name, max_tokens=max_tokens, ignore_eos=True, priority=priority)
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
            finished.append(name)

        first = threading.Thread(target=send, args=("first", 0, 40))
        first.start()
        wait_for(lambda: server.engine.scheduler.running)
        low = threading.Thread(target=send, args=("low", 5, 3))
        low.start()
        wait_for(lambda: len(server.engine.scheduler.waiting) == 1)
        urgent = threading.Thread(target=send, args=("urgent", -1, 3))
        urgent.start()
        for t in (first, low, urgent):
            t.join()
    assert finished == ["first", "urgent", "low"]


@pytest.mark.parametrize("priority,message", [(3, "--scheduling-policy priority"), ("high", "must be an integer")])
def test_priority_refused_where_it_cannot_apply(server, priority, message):
    r = httpx.post(server.url + "/v1/completions", json=dict(model="tiny", prompt="x", priority=priority))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "priority" and message in r.json()["error"]["message"]


# ------------------------------------------------------------ week 21's CPU tier: no tier, no tier metrics


def test_no_cpu_tier_no_tier_metrics():
    with ServerThread(engine_kwargs=dict(max_model_len=64, num_blocks=16)) as server:
        names = {name for name, _ in scrape(server.url)}
    assert "nanoserve:prefix_cache_hits_total" in names and "nanoserve:kv_reloads_total" not in names
