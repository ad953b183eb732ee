"""Week 16: what to watch while the server runs, exported for Prometheus at `GET /metrics`.

Three kinds of numbers, each gathered where it costs the engine nothing:

- **per request**, when it finishes: time to first token, the gaps between its tokens, its queue
  time and end-to-end latency, its prompt and output lengths, how it finished. The engine thread
  only stamps times it already keeps (`Sequence.token_times`); the `AsyncEngine` hands the
  finished request's `RequestMetrics` to `ServerMetrics.observe_request` on the event loop.
- **per HTTP response**: its endpoint and status, counted by the `Guard` middleware.
- **the engine's state**: running and waiting sequences, KV blocks, preemptions, prefix-cache
  counters (week 24: the tokens routed to each expert). Nobody updates these: `EngineCollector`
  reads them at scrape time. Issue 38: with several models, each loaded model's series carry a
  `model` label (`ModelsCollector`), beside which models are loaded, their loads and unloads, and
  the requests the rate limits refused.

The exposition format, the histograms' bookkeeping and the parser the tests use all come from
`prometheus-client`; the names follow the style users know from vLLM (`nanoserve:` prefix,
seconds, `_total` counters).
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.server.models import ModelRegistry
from nanoserve.server.rate_limits import RateLimiter

# Bucket upper bounds, in seconds or tokens: fine where the targets live (tens of ms), coarse beyond.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
UNKNOWN_CONTEXT = 2048  # the length buckets' top when no model has been loaded yet


def length_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets, scale = [], 1
    while scale < max_len:
        buckets += [b * scale for b in (1, 2, 5) if b * scale < max_len]
        scale *= 10
    return tuple(buckets) + (max_len,)


class ServerMetrics:
    """The server's metrics, in a registry of their own (two apps in one process never mix), of
    the models in `models` (issue 38: one or several) and the refusals of `rate_limits`."""

    def __init__(self, models: ModelRegistry, rate_limits: RateLimiter | None = None, sessions=None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("nanoserve:request_success", "Finished requests, by finish reason",
                                ["finished_reason"], registry=r)
        self.http = Counter("nanoserve:http_requests", "HTTP responses, by endpoint and status code",
                            ["endpoint", "status"], registry=r)
        self.prompt_tokens_total = Counter("nanoserve:prompt_tokens", "Prompt tokens of finished requests",
                                           registry=r)
        self.generation_tokens_total = Counter("nanoserve:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds", "Arrival to the first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("nanoserve:inter_token_latency_seconds", "Gap between consecutive output tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds", "Arrival to the last token",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("nanoserve:request_queue_time_seconds", "Arrival to the first KV blocks",
                                    buckets=REQUEST_BUCKETS, registry=r)
        lengths = length_buckets(max((slot.max_model_len or 0 for slot in models.slots.values()), default=0)
                                 or UNKNOWN_CONTEXT)
        self.prompt_len = Histogram("nanoserve:request_prompt_tokens", "Prompt length of finished requests",
                                    buckets=lengths, registry=r)
        self.output_len = Histogram("nanoserve:request_generation_tokens", "Output length of finished requests",
                                    buckets=lengths, registry=r)
        r.register(ModelsCollector(models, rate_limits))
        if sessions is not None:  # issue 38: a `SessionStore` (nanoserve/server/sessions.py) is its own collector
            r.register(sessions)

    def observe_request(self, output: RequestOutput, options: dict | None = None) -> None:
        """Record a finished request (an `AsyncEngine` listener). Its tokens' latencies count
        whatever the ending; its lengths and end-to-end time only if it ran to its end (an abort
        is the client leaving, not the server's latency)."""
        # >>> week16: observe-request
        m = output.metrics
        self.requests.labels(output.finish_reason).inc()
        self.generation_tokens_total.inc(m.num_output_tokens)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.token_times:
            self.ttft.observe(m.token_times[0] - m.arrival_time)
        for before, after in zip(m.token_times, m.token_times[1:]):
            self.itl.observe(after - before)
        if output.finish_reason != "abort":
            self.prompt_tokens_total.inc(m.num_prompt_tokens)
            self.prompt_len.observe(m.num_prompt_tokens)
            self.output_len.observe(m.num_output_tokens)
            self.e2e.observe(m.finished_time - m.arrival_time)
        # <<< week16: observe-request

    def observe_http(self, path: str, status: int) -> None:
        """Count one response (the `Guard` middleware calls this). Unknown paths are one label,
        "other": a label per path a scanner tries would grow the series without bound."""
        self.http.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text format's body and content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineCollector:
    """Reads the engine's state when Prometheus scrapes (`AsyncEngine.stats`), so the engine
    thread never updates a metric."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        """The engine's state as Prometheus metric families: gauges for what goes up and down,
        counters for what only grows (the prefix-cache and speculative ones when those are on)."""
        # >>> week16: engine-metrics
        s = self.engine.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"nanoserve:{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"nanoserve:{name}", doc, value=value)

        yield gauge("num_requests_running", "Sequences holding KV blocks", s["running"])
        yield gauge("num_requests_waiting", "Sequences in the queue (preempted ones included)", s["waiting"])
        yield gauge("num_requests_in_flight", "Requests the server has accepted and not finished",
                    self.engine.num_pending)
        yield gauge("kv_cache_usage_perc", "Share of the KV blocks in use (0 to 1)",
                    s["kv_blocks_used"] / s["kv_blocks_total"])
        yield gauge("kv_blocks_used", "KV blocks in use", s["kv_blocks_used"])
        yield gauge("kv_blocks_total", "KV blocks in the pool", s["kv_blocks_total"])
        yield counter("num_preemptions", "Sequences preempted to free KV blocks", s["preemptions"])
        yield counter("engine_steps", "Engine steps run", s["steps"])
        yield counter("scheduled_tokens", "Tokens sent through the model (prefill and decode)",
                      s["scheduled_tokens"])
        if "prefix_cache" in s:  # week 14, when it is on: counted in tokens, as vLLM does
            p = s["prefix_cache"]
            yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", p["lookup_tokens"])
            yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", p["hit_tokens"])
            yield counter("prefix_cache_evictions", "Cached blocks evicted", p["evictions"])
        if "speculative" in s:  # week 17, when it is on
            p = s["speculative"]
            yield counter("spec_decode_num_draft_tokens", "Guessed tokens sent to verification", p["proposed"])
            yield counter("spec_decode_num_accepted_tokens", "Guessed tokens the target accepted", p["accepted"])
            yield counter("spec_decode_num_emitted_tokens", "Tokens emitted by verification steps", p["emitted"])
        # <<< week16: engine-metrics
        yield from cpu_tier_metrics(self.engine.stats().get("prefix_cache"))
        yield from kv_transfer_metrics(self.engine.stats().get("kv_transfer"))
        yield from expert_load_metrics(s.get("expert_load"))
        yield from held_kv_metrics(s.get("held_kv"))


class ModelsCollector:
    """Issue 38: `EngineCollector` over every loaded model, read through the registry at scrape time
    (so an unloaded engine is never kept alive by its collector). One model's series are week 16's;
    with several, each model's carry a `model` label. Then the models' own: loaded or not, loads,
    unloads by reason (lru: evicted for another; operator: POST .../unload); and with rate limits,
    the requests they refused."""

    def __init__(self, models: ModelRegistry, rate_limits: RateLimiter | None = None):
        self.models, self.rate_limits = models, rate_limits

    def collect(self):
        loaded = self.models.loaded()
        if len(self.models.names) == 1:
            for served in loaded:
                yield from EngineCollector(served.engine).collect()
        else:
            merged: dict[str, Metric] = {}  # one family per name, a sample per model
            for served in loaded:
                for family in EngineCollector(served.engine).collect():
                    into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                    for sample in family.samples:
                        into.add_sample(sample.name, {**sample.labels, "model": served.name}, sample.value)
            yield from merged.values()
        yield from model_metrics(self.models)
        if self.rate_limits is not None:
            refused = CounterMetricFamily("nanoserve:rate_limited_requests", "Requests refused with a 429 by the rate "
                                          "limits, by limit (requests or tokens per minute)", labels=["limit"])
            for limit in ("requests", "tokens"):
                refused.add_metric([limit], self.rate_limits.refused[limit])
            yield refused


def model_metrics(models: ModelRegistry):
    """Issue 38: each model's state, loads and unloads."""
    loaded = GaugeMetricFamily("nanoserve:model_loaded", "1 while the model is resident, else 0", labels=["model"])
    loads = CounterMetricFamily("nanoserve:model_loads", "Times the model was loaded", labels=["model"])
    unloads = CounterMetricFamily("nanoserve:model_unloads", "Times the model was unloaded, by reason (lru: evicted "
                                  "for another model; operator: POST /v1/models/{name}/unload)", labels=["model", "reason"])
    for slot in models.slots.values():
        loaded.add_metric([slot.name], float(slot.served is not None))
        loads.add_metric([slot.name], slot.loads)
        for reason, count in slot.unloads.items():
            unloads.add_metric([slot.name, reason], count)
    yield from (loaded, loads, unloads)


def held_kv_metrics(h: dict | None):
    """Issue 38: the KV that finished requests hold for a later one (sessions), and what came of it."""
    if h is None:
        return
    yield GaugeMetricFamily("nanoserve:held_kv_blocks", "KV blocks held by finished requests for a resume", value=h["blocks"])
    yield CounterMetricFamily("nanoserve:held_kv_resumed_tokens", "Prompt tokens not prefilled: taken from held KV",
                              value=h["resumed_tokens"])
    yield CounterMetricFamily("nanoserve:held_kv_evictions", "Held KV entries evicted for room (before any preemption)",
                              value=h["evictions"])


def expert_load_metrics(load: dict[int, list[int]] | None):
    """Week 24, for a mixture of experts: the token-expert pairs each expert of each MoE layer received
    (the routing's histogram: `sum by (expert)` for the model's, max over mean for the imbalance)."""
    if load is None:
        return
    family = CounterMetricFamily("nanoserve:moe_expert_tokens", "Token-expert pairs routed to each expert, by MoE "
                                 "layer", labels=["layer", "expert"])
    for layer, counts in load.items():
        for expert, count in enumerate(counts):
            family.add_metric([str(layer), str(expert)], count)
    yield family


def kv_transfer_metrics(t: dict | None):
    """Issue 35, on an instance of a disaggregated pair (`t`: its KV connector's counters): the
    transfers and their bytes, each way, the failed ones, and the seconds the received ones took
    (rate(seconds) / rate(received): the mean time of a transfer; bytes over seconds: its bandwidth)."""
    if t is None:
        return
    for name, doc, sent, received in (("kv_transfers", "Requests' KV moved between instances", "sent", "received"),
                                      ("kv_transfer_bytes", "Bytes of KV moved between instances", "bytes_sent",
                                       "bytes_received")):
        family = CounterMetricFamily(f"nanoserve:{name}", doc, labels=["direction"])
        family.add_metric(["sent"], t[sent])
        family.add_metric(["received"], t[received])
        yield family
    yield CounterMetricFamily("nanoserve:kv_transfer_failures", "KV transfers that failed or timed out (their "
                              "requests failed)", value=t["failed"])
    yield CounterMetricFamily("nanoserve:kv_transfer_seconds", "Seconds the received KV transfers took, from the "
                              "pull to the bytes in the blocks", value=t["seconds_received"])


def cpu_tier_metrics(p: dict | None):
    """Issue 35, when the prefix cache has a CPU tier behind it (`p`: its counters): the hits of
    each tier, in prompt tokens, and the blocks copied each way and dropped from the CPU tier."""
    if p is None or "cpu_hit_tokens" not in p:
        return
    hits = CounterMetricFamily("nanoserve:prefix_cache_tier_hits", "Prompt tokens found in the prefix cache, by the "
                               "tier that held them", labels=["tier"])
    hits.add_metric(["gpu"], p["gpu_hit_tokens"])
    hits.add_metric(["cpu"], p["cpu_hit_tokens"])
    yield hits
    yield CounterMetricFamily("nanoserve:kv_offloads", "KV blocks copied from the GPU pool to the CPU tier",
                              value=p["offloads"])
    yield CounterMetricFamily("nanoserve:kv_reloads", "KV blocks copied back from the CPU tier to the GPU pool",
                              value=p["reloads"])
    yield CounterMetricFamily("nanoserve:cpu_cache_evictions", "Blocks dropped from the full CPU tier for good",
                              value=p["cpu_evictions"])


class RequestLog:
    """One JSON line per finished request (an `AsyncEngine` listener), through the
    `nanoserve.requests` logger."""

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or logging.getLogger("nanoserve.requests")

    def __call__(self, output: RequestOutput, options: dict) -> None:
        m = output.metrics

        def seconds(t: float | None) -> float | None:
            return None if t is None else round(t, 6)

        record = {
            "time": round(time.time(), 3),
            "request_id": options.get("request_id"),
            "prompt_tokens": m.num_prompt_tokens,
            "output_tokens": m.num_output_tokens,
            "finish_reason": output.finish_reason,
            "queue_s": seconds(m.first_scheduled_time and m.first_scheduled_time - m.arrival_time),
            "ttft_s": seconds(m.token_times[0] - m.arrival_time if m.token_times else None),
            "e2e_s": seconds(m.finished_time - m.arrival_time),
            "preemptions": m.num_preemptions,
            "priority": options.get("priority", 0),
        }
        self.logger.info(json.dumps(record))
