"""`bench latency`: one request, token by token; the step's phases; graph replays alone; the
HF and compiled baselines side by side."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.bench.common import (
    copy_bandwidth,
    free_gpu,
    hf_model,
    kv_pool,
    print_table,
    save_and_plot,
    sync_device,
    vocab_size_of,
)


def step_breakdown(engine, steps: int) -> dict[str, float]:
    """Milliseconds per step spent in each phase of `Engine.step`, over the next `steps` steps.

    The engine's scheduler and runner are timed from the outside (their methods wrapped for the
    measurement, then restored); the GPU is synchronised after the forward pass, so 'forward'
    holds the GPU time. The loop runs plainly here, without async scheduling, so
    that each phase is seen whole. 'sample' is the rest of the step: sampling, the device->host copy of the
    tokens, and building the outputs.
    """
    device = str(engine.runner.device)
    totals = dict(schedule=0.0, forward=0.0, sample=0.0, update=0.0)
    engine.deliver(engine.resolve_in_flight())  # measured on the plain loop: async scheduling would hide phases
    was_async, engine.async_scheduling = engine.async_scheduling, False

    def timed(obj, name: str, key: str, sync: bool = False) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            if sync:
                sync_device(device)
            totals[key] += time.perf_counter() - start
            return result

        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "execute", "forward", sync=True)
    timed(engine.scheduler, "update", "update")
    try:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    finally:
        for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "execute"), (engine.scheduler, "update")):
            del obj.__dict__[name]  # back to the class's method
        engine.async_scheduling = was_async
    totals["sample"] = total - totals["schedule"] - totals["forward"] - totals["update"]
    return {k: 1e3 * v / steps for k, v in totals.items()}


def replay_ms(engine, reps: int = 200) -> float | None:
    """GPU time of one batch-1 decode graph replay alone: the floor for a step. None without
    captured graphs, and with tensor parallelism (week 18): a rank's graph holds its collectives,
    and the driver replaying its own alone would wait for the other ranks' forever."""
    graphs = engine.runner.graphs
    if graphs is None or not graphs.capture or engine.workers is not None:
        return None
    graphs.graphs[1].replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graphs.graphs[1].replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / reps


def bench_latency(args) -> dict:
    from tqdm.auto import tqdm

    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from nanoserve.model.loader import resolve_model_dir
    from nanoserve.sampling.params import SamplingParams

    model_dir = resolve_model_dir(args.model)
    rng = random.Random(0)
    prompt = [rng.randrange(vocab_size_of(model_dir)) for _ in range(args.prompt_len)]
    engine = Engine(replace(EngineConfig.from_args(args), model=model_dir))
    pool = kv_pool(engine)  # issue 33: --kv-cache-dtype fp8 halves the K/V a step reads at long prompts
    device = str(engine.runner.device)
    dtype = engine.model.embed_tokens.weight.dtype
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(engine.model)
    roofline = bandwidth / weights
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    speeds = []
    for run in tqdm(range(args.runs), desc="nanoserve batch 1", unit="run"):
        engine.add_request(prompt, params)
        times = []  # when each token reached the host: a step returns outputs only then
        while engine.has_unfinished():
            if engine.step():
                times.append(time.perf_counter())
        speeds.append((args.new_tokens - 1) / (times[-1] - times[0]))
    ours = statistics.median(speeds[1:])  # the first run compiles kernels
    captured = engine.runner.graphs is not None and engine.runner.graphs.capture
    label = "nanoserve" + (" (CUDA graphs)" if captured else " (eager)")
    engine.add_request(prompt, params)
    engine.step()  # the prefill
    breakdown = step_breakdown(engine, min(32, args.new_tokens - 2))
    while engine.has_unfinished():
        engine.step()
    floor = replay_ms(engine)
    if args.profile and device.startswith("cuda"):
        engine.add_request(prompt, params)
        engine.step()  # the prefill
        profile_steps(engine)
        engine.abort(next(iter(engine.requests)))
    # Stop the other ranks now. No reference to the runner's CUDA graphs may outlive this: with
    # tensor parallelism they hold the NCCL communicator, and leaving the group under them hung.
    engine.close()
    del engine
    free_gpu()
    rows = [dict(engine=label, tok_s=ours, ms_per_token=1e3 / ours, pct_roofline=100 * ours / roofline,
                 min_tok_s=min(speeds[1:]), max_tok_s=max(speeds[1:]))]
    if args.baseline:
        compiled = device.startswith("cuda")
        runs = baseline_latency(model_dir, prompt, args.new_tokens, dtype, device, compiled, args.runs)
        base = statistics.median(runs[1:])
        rows.append(dict(engine="torch.compile static cache" if compiled else "static cache (eager: no CUDA)",
                         tok_s=base, ms_per_token=1e3 / base, pct_roofline=100 * base / roofline,
                         min_tok_s=min(runs[1:]), max_tok_s=max(runs[1:])))
        free_gpu()
    if args.hf:
        theirs = hf_latency(model_dir, prompt, args.new_tokens, dtype, device)
        rows.append(dict(engine="HF transformers generate", tok_s=theirs, ms_per_token=1e3 / theirs,
                         pct_roofline=100 * theirs / roofline))
    print(f"\nweights {weights / 1e9:.3f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s -> roofline "
          f"{roofline:.0f} tok/s ({1e3 / roofline:.3f} ms/token)")
    print("per decode step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items())
          + (f"; one graph replay alone {floor:.3f}" if floor else ""))
    print_table(f"batch-1 decode (median of runs 2-{args.runs}, min and max beside it)", rows,
                [("engine", "engine", ""), ("tok_s", "tok/s", ".1f"), ("min_tok_s", "min", ".1f"),
                 ("max_tok_s", "max", ".1f"), ("ms_per_token", "ms/token", ".3f"),
                 ("pct_roofline", "% of roofline", ".1f")])
    result = dict(model=str(args.model), prompt_len=args.prompt_len, new_tokens=args.new_tokens, dtype=str(dtype),
                  weight_bytes=weights, copy_gbs=bandwidth / 1e9, roofline_tok_s=roofline,
                  step_breakdown_ms=breakdown, graph_replay_ms=floor, runs_tok_s=speeds, rows=rows, **pool)

    def draw(ax):
        ax.barh([r["engine"] for r in rows], [r["tok_s"] for r in rows], color=["tab:blue", "tab:gray"][: len(rows)])
        ax.axvline(roofline, color="tab:red", ls="--", label=f"bandwidth roofline {roofline:.0f} tok/s")
        ax.set_xlabel("batch-1 decode, tokens/s")
        ax.legend(loc="lower right")

    save_and_plot(args, "latency", result, draw)
    return result


def weight_bytes(model) -> int:
    """The bytes a decode step reads for the weights: the parameters, and the codes, scales and
    offsets of quantized layers, or FP8's weights and scales (buffers, not parameters: issue 33)."""
    from nanoserve.model.quantized import Fp8Linear, QuantizedLinear

    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return dense + sum(m.weight_bytes() for m in model.modules() if isinstance(m, (QuantizedLinear, Fp8Linear)))


def profile_steps(engine, steps: int = 20) -> None:
    """Print torch profiles of the next `steps` engine steps: by GPU time, then by host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=20))
    print(table.table(sort_by="cpu_time_total", row_limit=20))


class _TokenClock:
    """A `generate` streamer that only notes when each new token came out (the first `put` is
    the prompt)."""

    def __init__(self, device: str):
        self.device, self.times, self.seen_prompt = device, [], False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        sync_device(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def baseline_latency(model_dir: Path, prompt: list[int], new_tokens: int, dtype: torch.dtype, device: str,
                     compiled: bool, runs: int = 5) -> list[float]:
    """Batch-1 decode speed of the same weights through a dense static KV cache, each step compiled
    with torch.compile (nanoserve/bench/compiled_baseline.py): `runs` runs, the first compiles."""
    from nanoserve.bench.compiled_baseline import CompiledStaticDecoder
    from nanoserve.model.loader import load_model

    model = load_model(model_dir, dtype=dtype, device=device)
    decoder = CompiledStaticDecoder(model, max_len=len(prompt) + new_tokens, compile=compiled)
    speeds = []
    for _ in range(runs):
        times: list[float] = []
        decoder.generate(prompt, new_tokens, on_token=lambda i: times.append(time.perf_counter()))
        speeds.append((new_tokens - 1) / (times[-1] - times[0]))
    return speeds


def hf_latency(model_dir: Path, prompt: list[int], new_tokens: int, dtype: torch.dtype, device: str) -> float:
    """HF `generate`'s decode speed, measured as nanoserve's: (tokens - 1) / (first to last
    token), the median of three runs after a warm-up."""
    hf = hf_model(model_dir, dtype, device)
    ids = torch.tensor([prompt], device=device)
    speeds = []
    with torch.no_grad():
        for _ in range(4):
            clock = _TokenClock(device)
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
            speeds.append((len(clock.times) - 1) / (clock.times[-1] - clock.times[0]))
    del hf
    free_gpu()
    return statistics.median(speeds[1:])

