"""`bench serving`: a server under an arrival process, TTFT and ITL as a client sees them."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from nanoserve.bench.common import print_table, save_and_plot, vocab_size_of
from nanoserve.scheduler.simulator import percentile

REFERENCE = Path(__file__).resolve().parents[1]  # the nanoserve/ package this file belongs to


def bench_serving(args, reference: bool = False) -> dict:
    """The serving benchmark on the engine NANOSERVE_WORKSPACE names (the reference if it is
    not set, or if `reference`)."""
    import asyncio
    import os
    import subprocess

    import httpx

    from nanoserve.course.stubs import ENV_VAR, workspace_from_env
    from nanoserve.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", str(Path(model_dir).resolve()),
           "--served-model-name", "bench", "--port", str(args.port), "--log-level", "warning"]
    cmd += engine_options(args) + args.server_args.split()
    # `python -m` puts its working directory first on sys.path: run the server in the learner's
    # workspace and it imports their nanoserve, whatever PYTHONPATH or the installed package say;
    # run it beside this package (the reference) otherwise, whatever folder the command ran in.
    workspace = None if reference else workspace_from_env()
    served = f"{workspace / 'nanoserve'} ({ENV_VAR}={workspace})" if workspace else \
        f"{REFERENCE} (the reference{'' if reference else f': {ENV_VAR} is not set'})"
    print(f"serving the engine in {served}")
    server = subprocess.Popen(cmd, env=os.environ.copy(), cwd=workspace or REFERENCE.parent)
    try:
        deadline = time.time() + 600
        while True:
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not come up") from None
                time.sleep(0.5)
        vocab = vocab_size_of(model_dir)
        asyncio.run(run_rate(url, 8.0, 4, (16, 32), (4, 8), vocab, seed=99))  # warm-up
        # A disaggregated pair (issue 35): its decode instance, one port above the proxy's prefill one, counts
        # the KV it received; read before and after each rate, the difference is that rate's transfers.
        decode_url = f"http://127.0.0.1:{args.port + 2}" if "--disaggregated" in args.server_args.split() else None
        rows = []
        for i, rate in enumerate(map(float, args.rates.split(","))):
            before = kv_received(decode_url)
            rows.append(asyncio.run(run_rate(url, rate, args.requests, args.prompt_range, args.serving_output_range,
                                              vocab, seed=i)))
            rows[-1].update(kv_transfer_row(before, kv_received(decode_url)))
    finally:
        server.terminate()
        server.wait(60)
    print_table(f"serving: {args.requests} streaming requests per rate, prompts U{list(args.prompt_range)}, outputs "
                f"U{list(args.serving_output_range)}", rows,
                [("rate", "req/s", ".1f"), ("output_tok_s", "output tok/s", ",.0f"),
                 ("ttft_p50_ms", "TTFT p50 ms", ".1f"), ("ttft_p99_ms", "TTFT p99 ms", ".1f"),
                 ("itl_p50_ms", "ITL p50 ms", ".1f"), ("itl_p99_ms", "ITL p99 ms", ".1f")]
                + ([("kv_transfers", "KV moved", "d"), ("kv_ms_per_transfer", "ms a transfer", ".2f"),
                    ("kv_gb_per_s", "GB/s", ".1f")] if any("kv_transfers" in r for r in rows) else []))
    result = dict(model=str(args.model), kv_blocks=health.get("kv_blocks_total"), prompt_len=args.prompt_range,
                  output_len=args.serving_output_range, rows=rows)

    def draw(ax):
        rates = [r["rate"] for r in rows]
        for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("itl_p50_ms", "s-"), ("itl_p99_ms", "s--")):
            ax.plot(rates, [r[key] for r in rows], style, label=key.replace("_ms", "").replace("_", " "))
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend()

    save_and_plot(args, "serving", result, draw)
    return result


async def one_request(client, body: dict) -> dict:
    start = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["text"] or choice["finish_reason"] is None:
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("the stream carried no token")
    return {"ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:])], "end": times[-1]}


async def run_rate(url: str, rate: float, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                    vocab: int, seed: int) -> dict:
    import asyncio

    import httpx
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks, out_tokens = [], 0
        bar = tqdm(total=n, desc=f"{rate:g} req/s", unit="req")
        t0 = time.perf_counter()
        for _ in range(n):
            max_tokens = rng.randint(*output_len)
            out_tokens += max_tokens
            body = {"model": "bench", "prompt": [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            task = asyncio.create_task(one_request(client, body))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        bar.close()
        elapsed = max(r["end"] for r in results) - t0
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    return dict(rate=rate, requests=n, seconds=elapsed, output_tok_s=out_tokens / elapsed,
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
                itl_p50_ms=1e3 * percentile(itl, 50), itl_p99_ms=1e3 * percentile(itl, 99))


def kv_received(url: str | None) -> dict | None:
    """An instance's received-KV counters from its /metrics (None without an instance to ask)."""
    if url is None:
        return None
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = {"nanoserve:kv_transfers": "count", "nanoserve:kv_transfer_bytes": "bytes",
             "nanoserve:kv_transfer_seconds": "seconds"}
    out = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in names and sample.labels.get("direction", "received") == "received":
                out[names[name]] = sample.value
    return out


def kv_transfer_row(before: dict | None, after: dict | None) -> dict:
    """The KV transfers between two readings: how many, their mean time (from the pull to the bytes
    in the blocks, queueing behind earlier pulls included) and bytes over those seconds."""
    if before is None or after is None:
        return {}
    count, num_bytes, seconds = (after[k] - before[k] for k in ("count", "bytes", "seconds"))
    return dict(kv_transfers=int(count), kv_gb=num_bytes / 1e9,
                kv_ms_per_transfer=1e3 * seconds / count if count else float("nan"),
                kv_gb_per_s=num_bytes / 1e9 / seconds if seconds else float("nan"))


def engine_options(args: argparse.Namespace) -> list[str]:
    """The engine options given to `bench`, as `nanoserve serve` options (serving runs a server)."""
    out = []
    for name in ("dtype", "device", "attention_backend", "block_size", "num_blocks", "kv_cache_memory",
                 "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "batching", "scheduling_policy", "speculative", "draft_model", "tensor_parallel_size",
                 "expert_parallel_size", "distributed_executor", "ray_placement", "data_parallel_size"):
        value = getattr(args, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    flags = [("--no-preemption", not args.preemption), ("--no-cuda-graphs", args.cuda_graphs is False),
             ("--no-fused-kernels", args.fused_kernels is False), ("--enable-prefix-caching", args.enable_prefix_caching),
             ("--no-enable-prefix-caching", args.enable_prefix_caching is False),
             ("--enable-chunked-prefill", args.enable_chunked_prefill),
             ("--no-enable-chunked-prefill", args.enable_chunked_prefill is False),
             ("--async-scheduling", args.async_scheduling is True), ("--no-async-scheduling", args.async_scheduling is False)]
    if args.speculative:
        out += ["--num-speculative-tokens", str(args.num_speculative_tokens),
                "--speculative-max-batch", str(args.speculative_max_batch), "--ngram-min", str(args.ngram_min)]
    return out + [flag for flag, on in flags if on]
