"""Serving benchmark: Poisson arrivals over HTTP, TTFT and inter-token latency percentiles.

    python scripts/bench_serving.py --model /tmp/llama1b --rates 2,6,12 --requests 60 --out docs/bench

Starts `nanoserve serve` in a separate process (so the client's event loop does not share a
Python interpreter with the engine), then for each arrival rate sends requests whose gaps are
exponentially distributed (a Poisson process), each streaming (SSE) a completion of random
token ids with prompt and output lengths drawn uniformly from the given ranges, EOS ignored.
From the client side it records, per request, the time to first token (TTFT) and the gaps
between tokens (ITL), and reports p50/p99 of both and the output tokens/s over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
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
    return {"ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:])],
            "end": times[-1], "start": start}


async def run_rate(url: str, rate: float, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                   vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks, out_tokens = [], 0
        t0 = time.perf_counter()
        for _ in range(n):
            max_tokens = rng.randint(*output_len)
            out_tokens += max_tokens
            body = {"model": "bench", "prompt": [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            tasks.append(asyncio.create_task(one_request(client, body)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = max(r["end"] for r in results) - t0
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    return dict(rate=rate, requests=n, seconds=elapsed, output_tok_s=out_tokens / elapsed,
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
                itl_p50_ms=1e3 * percentile(itl, 50), itl_p99_ms=1e3 * percentile(itl, 99))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rates", default="2,6,12", help="requests per second")
    ap.add_argument("--requests", type=int, default=60, help="requests per rate")
    ap.add_argument("--prompt-len", default="100,1024")
    ap.add_argument("--output-len", default="100,512")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--server-args", default="", help="extra arguments for `nanoserve serve`")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", args.model, "--served-model-name", "bench",
           "--port", str(args.port), "--log-level", "warning", *args.server_args.split()]
    server = subprocess.Popen(cmd, env=os.environ.copy())
    try:
        deadline = time.time() + 300
        while True:
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not come up")
                time.sleep(1)
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"] if Path(args.model).is_dir() else 4096
        prompt_len = tuple(map(int, args.prompt_len.split(",")))
        output_len = tuple(map(int, args.output_len.split(",")))
        asyncio.run(run_rate(url, 4.0, 4, (16, 32), (8, 16), vocab, seed=99))  # warm-up
        rows = []
        for i, rate in enumerate(map(float, args.rates.split(","))):
            row = asyncio.run(run_rate(url, rate, args.requests, prompt_len, output_len, vocab, seed=i))
            rows.append(row)
            print(f"rate {rate:5.1f} req/s: {row['output_tok_s']:7.0f} output tok/s | TTFT p50 {row['ttft_p50_ms']:7.1f} "
                  f"p99 {row['ttft_p99_ms']:7.1f} ms | ITL p50 {row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:6.1f} ms",
                  flush=True)
    finally:
        server.terminate()
        server.wait(30)
    from bench_common import save_result

    save_result(args.out, "serving", model=args.model, kv_blocks=health["kv_blocks_total"],
                prompt_len=prompt_len, output_len=output_len, rows=rows)


if __name__ == "__main__":
    main()
