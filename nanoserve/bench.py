"""Week 12: `nanoserve bench`, three measurements with HuggingFace side by side.

    nanoserve bench latency    --model DIR    batch-1 decode tok/s, next to the bandwidth roofline
    nanoserve bench throughput --model DIR    offline: N requests at once, output tok/s
    nanoserve bench serving    --model DIR    Poisson arrivals over HTTP: TTFT and ITL p50/p99
    nanoserve bench all        --model DIR    the three, one after the other

Every run prints a table and writes `<out>/<name>.json` (the numbers, the machine, the
software, the date and the command) and `<out>/<name>.png`. `--quick` shrinks every workload
so that the whole thing runs in a minute on a CPU with the bundled tiny model (CI runs it).

The workloads (random token ids; EOS ignored, so every request produces exactly its length):
- latency: one prompt of --prompt-len tokens, --new-tokens greedy tokens, --runs times (5); the
  median of runs 2 onwards (the first compiles kernels), with their min and max. Decode speed leaves the prefill out:
  (tokens - 1) / (time from the first token to the last). The roofline is the speed
  of a step that does nothing but read every weight once at the measured copy bandwidth.
- throughput: --num-requests requests, prompt and output lengths uniform in --prompt-len and
  --output-len ([100, 1024] each by default), all submitted at once.
- serving: `nanoserve serve` in its own process (in the workspace NANOSERVE_WORKSPACE names, if
  set, so that it imports the learner's package); streaming requests with exponential gaps.
  `--check capstone-cpu` fixes the workload and checks the capstone's targets (nanoserve/capstone.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.simulator import percentile

QUICK = dict(prompt_len=16, new_tokens=24, num_requests=8, lengths=(8, 32), rates="4", requests=6,
             output_len=(8, 16))


# ------------------------------------------------------------------------------------ helpers


def copy_bandwidth(device: str, nbytes: int = 2**30) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return 2 * nbytes / (do_bench(lambda: dst.copy_(src), warmup=50, rep=300) * 1e-3)
    src = torch.empty(nbytes // 8, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, start = 10, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * src.numel() * reps / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _free_gpu() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def throughput_workload(n: int, vocab: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                        seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return prompts, [rng.randint(*output_len) for _ in range(n)]


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) if r.get(k) is not None else "-"
                                             for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for j, line in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def save_result(out_dir: str | Path, name: str, **fields) -> Path:
    """Write `fields` plus the GPU, the software, the date and the command to out_dir/name.json."""
    import platform

    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor()})",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                command="nanoserve " + " ".join(sys.argv[1:]) if sys.argv and "nanoserve" in sys.argv[0] else None,
                **fields)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(meta, indent=2))
    print(f"wrote {path}")
    return path


def _plot(path: Path, draw) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def _hf_model(model_dir: Path, dtype: torch.dtype, device: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


# ------------------------------------------------------------------------------------ latency


def step_breakdown(engine, steps: int) -> dict[str, float]:
    """Milliseconds per step spent in each phase of `Engine.step`, over the next `steps` steps.

    The engine's scheduler and runner are timed from the outside (their methods wrapped for the
    measurement, then restored); the GPU is synchronised after the forward pass, so 'forward'
    holds the GPU time. The loop runs plainly here, not a step ahead of the GPU (issue 20), so
    that each phase is seen whole. 'sample' is the rest of the step: sampling, the device->host copy of the
    tokens, and building the outputs.
    """
    device = str(engine.runner.device)
    totals = dict(schedule=0.0, forward=0.0, sample=0.0, update=0.0)
    engine.resolve_in_flight()  # measured on the plain loop: scheduling ahead (issue 20) would hide phases
    ahead, engine.schedule_ahead = engine.schedule_ahead, False

    def timed(obj, name: str, key: str, sync: bool = False) -> None:
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            if sync:
                _sync(device)
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
        engine.schedule_ahead = ahead
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

    from nanoserve.engine import Engine, EngineConfig
    from nanoserve.loader import resolve_model_dir
    from nanoserve.sampling import SamplingParams

    model_dir = resolve_model_dir(args.model)
    rng = random.Random(0)
    prompt = [rng.randrange(_vocab(model_dir)) for _ in range(args.prompt_len)]
    engine = Engine(replace(EngineConfig.from_args(args), model=model_dir))
    device = str(engine.runner.device)
    dtype = engine.model.embed_tokens.weight.dtype
    bandwidth = copy_bandwidth(device)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
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
    graphs = engine.runner.graphs
    label = "nanoserve" + (" (CUDA graphs)" if graphs is not None and graphs.capture else " (eager)")
    engine.add_request(prompt, params)
    engine.step()  # the prefill
    breakdown = step_breakdown(engine, min(32, args.new_tokens - 2))
    while engine.has_unfinished():
        engine.step()
    floor = replay_ms(engine)
    if args.profile and device.startswith("cuda"):
        engine.add_request(prompt, params)
        engine.step()  # the prefill
        _profile(engine)
        engine.abort(next(iter(engine.requests)))
    del engine
    _free_gpu()
    rows = [dict(engine=label, tok_s=ours, ms_per_token=1e3 / ours, pct_roofline=100 * ours / roofline,
                 min_tok_s=min(speeds[1:]), max_tok_s=max(speeds[1:]))]
    if args.baseline:
        compiled = device.startswith("cuda")
        runs = baseline_latency(model_dir, prompt, args.new_tokens, dtype, device, compiled, args.runs)
        base = statistics.median(runs[1:])
        rows.append(dict(engine="torch.compile static cache" if compiled else "static cache (eager: no CUDA)",
                         tok_s=base, ms_per_token=1e3 / base, pct_roofline=100 * base / roofline,
                         min_tok_s=min(runs[1:]), max_tok_s=max(runs[1:])))
        _free_gpu()
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
                  step_breakdown_ms=breakdown, graph_replay_ms=floor, runs_tok_s=speeds, rows=rows)

    def draw(ax):
        ax.barh([r["engine"] for r in rows], [r["tok_s"] for r in rows], color=["tab:blue", "tab:gray"][: len(rows)])
        ax.axvline(roofline, color="tab:red", ls="--", label=f"bandwidth roofline {roofline:.0f} tok/s")
        ax.set_xlabel("batch-1 decode, tokens/s")
        ax.legend(loc="lower right")

    _save(args, "latency", result, draw)
    return result


def _profile(engine, steps: int = 20) -> None:
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
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def baseline_latency(model_dir: Path, prompt: list[int], new_tokens: int, dtype: torch.dtype, device: str,
                     compiled: bool, runs: int = 5) -> list[float]:
    """Batch-1 decode speed of the same weights through a dense static KV cache, each step compiled
    with torch.compile (nanoserve/compiled_baseline.py): `runs` runs, the first compiles."""
    from nanoserve.compiled_baseline import CompiledStaticDecoder
    from nanoserve.loader import load_model

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
    hf = _hf_model(model_dir, dtype, device)
    ids = torch.tensor([prompt], device=device)
    speeds = []
    with torch.no_grad():
        for _ in range(4):
            clock = _TokenClock(device)
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
            speeds.append((len(clock.times) - 1) / (clock.times[-1] - clock.times[0]))
    del hf
    _free_gpu()
    return statistics.median(speeds[1:])


# --------------------------------------------------------------------------------- throughput


def bench_throughput(args) -> dict:
    from nanoserve.engine import LLM, EngineConfig
    from nanoserve.loader import resolve_model_dir
    from nanoserve.sampling import SamplingParams

    model_dir = resolve_model_dir(args.model)
    prompts, lengths = throughput_workload(args.num_requests, _vocab(model_dir), args.prompt_range, args.output_range)
    if args.data_parallel_size > 1:  # week 18: replicas, each with its share of the prompts
        return throughput_data_parallel(args, model_dir, prompts, lengths)
    llm = LLM(replace(EngineConfig.from_args(args), model=model_dir, trace=True))
    engine = llm.engine
    device, dtype = str(engine.runner.device), engine.model.embed_tokens.weight.dtype
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8)] * 4, use_tqdm=False)  # warm-up
    if args.profile:  # a full batch: every request admitted and decoding
        ids = [engine.add_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
        if device.startswith("cuda"):
            print("the first step (a prefill):")
            _profile(engine, 1)
        while engine.scheduler.waiting or any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running):
            engine.step()
        print(f"decode steps with {len(engine.scheduler.running)} sequences running:")
        print("per decode step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in step_breakdown(engine, 20).items()))
        if device.startswith("cuda"):
            _profile(engine, 10)
        for i in ids:
            engine.abort(i)
    steps0 = engine.num_steps
    engine.trace.clear()
    _sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    _sync(device)
    elapsed = time.perf_counter() - start
    # Where the wall time went: steps that prefill some prompt (eager), pure decode steps (graphs)
    prefill = sum(r.end - r.start for r in engine.trace if max(r.num_new_tokens) > 1)
    decode = sum(r.end - r.start for r in engine.trace if max(r.num_new_tokens) == 1)
    num_prefill = sum(max(r.num_new_tokens) > 1 for r in engine.trace)
    split = dict(prefill_steps=num_prefill, prefill_step_seconds=prefill, decode_step_seconds=decode,
                 other_seconds=elapsed - prefill - decode)
    print(f"{num_prefill} steps with a prefill: {prefill:.2f} s; {len(engine.trace) - num_prefill} decode steps: "
          f"{decode:.2f} s; outside steps: {elapsed - prefill - decode:.2f} s")
    out_tokens = sum(len(o.token_ids) for o in outs)
    assert out_tokens == sum(lengths), "every request must produce exactly its output length"
    rows = [dict(engine="nanoserve", output_tok_s=out_tokens / elapsed, seconds=elapsed,
                 steps=engine.num_steps - steps0, preemptions=engine.scheduler.num_preemptions)]
    kv_blocks = engine.runner.cache.num_blocks
    del llm, engine
    _free_gpu()
    if args.hf:
        seconds, finished = hf_throughput(model_dir, prompts, lengths, dtype, device, args.hf_time_limit)
        if finished == len(prompts):
            rows.append(dict(engine="HF transformers generate_batch", output_tok_s=out_tokens / seconds,
                             seconds=seconds))
        else:  # stopped at the time limit: all we know is an upper bound on its speed
            rows.append(dict(engine=f"HF generate_batch (stopped at {seconds:.0f} s, {finished}/{len(prompts)} "
                                    f"done; tok/s is an upper bound)", output_tok_s=out_tokens / seconds,
                             seconds=None, finished=finished, upper_bound=True))
    for r in rows:
        r["vs_hf"] = r["output_tok_s"] / rows[-1]["output_tok_s"] if args.hf else None
    print_table(f"offline throughput: {args.num_requests} requests, prompts U{list(args.prompt_range)}, outputs "
                f"U{list(args.output_range)} ({sum(map(len, prompts))} prompt, {out_tokens} output tokens)", rows,
                [("engine", "engine", ""), ("output_tok_s", "output tok/s", ",.0f"), ("seconds", "seconds", ".2f"),
                 ("steps", "steps", "d"), ("vs_hf", "x HF", ".1f")])
    result = dict(model=str(args.model), num_requests=args.num_requests, prompt_len=args.prompt_range,
                  output_len=args.output_range, prompt_tokens=sum(map(len, prompts)), output_tokens=out_tokens,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_blocks=kv_blocks, dtype=str(dtype), time_split=split, rows=rows)

    def draw(ax):
        ax.barh([r["engine"] for r in rows], [r["output_tok_s"] for r in rows], color=["tab:blue", "tab:gray"][: len(rows)])
        ax.set_xlabel("output tokens/s")

    _save(args, "throughput", result, draw)
    return result


def throughput_data_parallel(args, model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> dict:
    """Week 18: the same workload over --data-parallel-size replicas (processes on GPUs of their
    own: `nanoserve.data_parallel.generate_data_parallel`), timed from all loaded to all done."""
    from nanoserve.data_parallel import generate_data_parallel
    from nanoserve.engine import EngineConfig, default_device
    from nanoserve.sampling import SamplingParams

    config = replace(EngineConfig.from_args(args), model=model_dir)
    config.device = config.device or default_device()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs, elapsed = generate_data_parallel(config, prompts, params, args.data_parallel_size)
    out_tokens = sum(len(o.token_ids) for o in outs)
    assert out_tokens == sum(lengths), "every request must produce exactly its output length"
    n = args.data_parallel_size
    rows = [dict(engine=f"nanoserve, {n} replicas", output_tok_s=out_tokens / elapsed, seconds=elapsed)]
    print_table(f"offline throughput: {args.num_requests} requests over {n} replicas, prompts "
                f"U{list(args.prompt_range)}, outputs U{list(args.output_range)} ({out_tokens} output tokens)", rows,
                [("engine", "engine", ""), ("output_tok_s", "output tok/s", ",.0f"), ("seconds", "seconds", ".2f")])
    result = dict(model=str(args.model), num_requests=args.num_requests, prompt_len=args.prompt_range,
                  output_len=args.output_range, output_tokens=out_tokens, data_parallel_size=n,
                  tensor_parallel_size=config.tensor_parallel_size, rows=rows)

    def draw(ax):
        ax.barh([r["engine"] for r in rows], [r["output_tok_s"] for r in rows], color="tab:blue")
        ax.set_xlabel("output tokens/s")

    _save(args, "throughput", result, draw)
    return result


def hf_throughput(model_dir: Path, prompts: list[list[int]], lengths: list[int], dtype: torch.dtype,
                  device: str, time_limit: float | None = None) -> tuple[float, int]:
    """(seconds, requests finished) for HF transformers' continuous batching (the manager behind
    `generate_batch`) on the workload. `generate_batch` itself takes one max_new_tokens for all
    requests; its manager takes one per request, which is the same workload as ours. With a
    time limit, it stops there and reports how many requests had finished."""
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    hf = _hf_model(model_dir, dtype, device)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=0)
    generated = finished = 0
    with torch.no_grad():
        hf.generate_batch(inputs=[p[:16] for p in prompts[:4]], generation_config=config, max_new_tokens=8)  # warm-up
        manager = hf.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            _sync(device)
            start = time.perf_counter()
            for p, n in zip(prompts, lengths):
                manager.add_request(p, max_new_tokens=n)
            with tqdm(total=len(prompts), desc="HF generate_batch", unit="req") as bar:
                while finished < len(prompts):
                    if time_limit is not None and time.perf_counter() - start > time_limit:
                        break
                    result = manager.get_result(timeout=1)
                    if result is not None and result.is_finished():
                        generated += len(result.generated_tokens)
                        finished += 1
                        bar.update(1)
                    elif result is None and not manager.is_running():
                        raise RuntimeError("HF's continuous batching thread stopped")
            _sync(device)
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True)
    if finished == len(prompts) and generated != sum(lengths):
        raise RuntimeError(f"HF generated {generated} tokens, the workload asks for {sum(lengths)}")
    del hf, manager
    _free_gpu()
    return seconds, finished


# ------------------------------------------------------------------------------------ serving


def bench_serving(args) -> dict:
    import asyncio
    import os
    import subprocess

    import httpx

    from nanoserve.course import ENV_VAR, workspace_from_env
    from nanoserve.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", str(Path(model_dir).resolve()),
           "--served-model-name", "bench", "--port", str(args.port), "--log-level", "warning"]
    cmd += _engine_options(args) + args.server_args.split()
    # `python -m` puts its working directory first on sys.path: run the server in the learner's
    # workspace and it imports their nanoserve, whatever PYTHONPATH or the installed package say.
    workspace = workspace_from_env()
    served = f"{workspace / 'nanoserve'} ({ENV_VAR}={workspace})" if workspace else \
        f"{Path(__file__).parent} (the reference: {ENV_VAR} is not set)"
    print(f"serving the engine in {served}")
    server = subprocess.Popen(cmd, env=os.environ.copy(), cwd=workspace)
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
        vocab = _vocab(model_dir)
        asyncio.run(_run_rate(url, 8.0, 4, (16, 32), (4, 8), vocab, seed=99))  # warm-up
        rows = []
        for i, rate in enumerate(map(float, args.rates.split(","))):
            rows.append(asyncio.run(_run_rate(url, rate, args.requests, args.prompt_range, args.serving_output_range,
                                              vocab, seed=i)))
    finally:
        server.terminate()
        server.wait(60)
    print_table(f"serving: {args.requests} streaming requests per rate, prompts U{list(args.prompt_range)}, outputs "
                f"U{list(args.serving_output_range)}", rows,
                [("rate", "req/s", ".1f"), ("output_tok_s", "output tok/s", ",.0f"),
                 ("ttft_p50_ms", "TTFT p50 ms", ".1f"), ("ttft_p99_ms", "TTFT p99 ms", ".1f"),
                 ("itl_p50_ms", "ITL p50 ms", ".1f"), ("itl_p99_ms", "ITL p99 ms", ".1f")])
    result = dict(model=str(args.model), kv_blocks=health["kv_blocks_total"], prompt_len=args.prompt_range,
                  output_len=args.serving_output_range, rows=rows)

    def draw(ax):
        rates = [r["rate"] for r in rows]
        for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("itl_p50_ms", "s-"), ("itl_p99_ms", "s--")):
            ax.plot(rates, [r[key] for r in rows], style, label=key.replace("_ms", "").replace("_", " "))
        ax.set_xlabel("arrival rate, requests/s")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend()

    _save(args, "serving", result, draw)
    return result


async def _one_request(client, body: dict) -> dict:
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


async def _run_rate(url: str, rate: float, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
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
            task = asyncio.create_task(_one_request(client, body))
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


# ------------------------------------------------------------------------------ command line


def _save(args, name: str, result: dict, draw) -> None:
    save_result(args.out, name, **result)
    _plot(Path(args.out) / f"{name}.png", draw)


def _pair(text: str) -> tuple[int, int]:
    lo, hi = map(int, text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 'LOW,HIGH' with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def _engine_options(args: argparse.Namespace) -> list[str]:
    """The engine options given to `bench`, as `nanoserve serve` options (serving runs a server)."""
    out = []
    for name in ("dtype", "device", "attention_backend", "block_size", "num_blocks", "kv_cache_memory",
                 "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "scheduler_policy", "scheduling_policy", "speculative", "draft_model", "tensor_parallel_size",
                 "distributed_executor", "data_parallel_size"):
        value = getattr(args, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    flags = [("--no-preemption", not args.preemption), ("--no-cuda-graphs", args.cuda_graphs is False),
             ("--no-fused-kernels", args.fused_kernels is False), ("--enable-prefix-caching", args.enable_prefix_caching),
             ("--no-enable-prefix-caching", args.enable_prefix_caching is False),
             ("--enable-chunked-prefill", args.enable_chunked_prefill),
             ("--async-scheduling", args.async_scheduling is True), ("--no-async-scheduling", args.async_scheduling is False)]
    if args.speculative:
        out += ["--num-speculative-tokens", str(args.num_speculative_tokens),
                "--speculative-max-batch", str(args.speculative_max_batch), "--ngram-min", str(args.ngram_min)]
    return out + [flag for flag, on in flags if on]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from nanoserve import bench_prefix, bench_spec
    from nanoserve.capstone import TRACKS
    from nanoserve.engine import EngineConfig

    p.add_argument("what", choices=["latency", "throughput", "serving", "prefix", "spec", "all"],
                   help="all: latency, throughput and serving; prefix: week 14's prefix-caching workloads; "
                        "spec: week 17's speculative decoding at batch 1")
    p.add_argument("--out", default="bench-results", help="folder for the JSON files and plots")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test that runs on a CPU")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HuggingFace side-by-side runs")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="latency: skip the torch.compile static-cache baseline")
    p.add_argument("--prompt-len", type=int, default=128, help="latency: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256, help="latency: tokens to generate")
    p.add_argument("--runs", type=int, default=None, help="latency: timed runs (default 5; the first one compiles, "
                   "so at least 2)")
    p.add_argument("--num-requests", type=int, default=256, help="throughput: requests")
    p.add_argument("--lengths", type=_pair, default=(100, 1024), help="throughput and serving: prompt lengths "
                   "LOW,HIGH; throughput outputs too")
    p.add_argument("--output-len", type=_pair, default=(100, 512), help="serving: output lengths LOW,HIGH")
    p.add_argument("--rates", default="2,6,12", help="serving: arrival rates, requests/s")
    p.add_argument("--requests", type=int, default=60, help="serving: requests per rate")
    p.add_argument("--port", type=int, default=8471, help="serving: the server's port")
    p.add_argument("--server-args", default="", help="serving: more options for `nanoserve serve`, in one string "
                   "given with an = sign: --server-args=\"--no-cuda-graphs\"")
    p.add_argument("--hf-time-limit", type=float, default=None,
                   help="throughput: stop HF after this many seconds (its speed is then reported as a bound)")
    p.add_argument("--profile", action="store_true", help="latency, throughput: where the time of a decode step goes")
    p.add_argument("--check", choices=sorted(TRACKS), default=None,
                   help="serving: run a capstone track's workload and check its targets (weeks/capstone/README.md)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="throughput: split the requests over this many replicas, each a process on GPUs of its "
                        "own; serving: serve them behind the data-parallel front (week 18)")
    bench_prefix.add_arguments(p)
    bench_spec.add_arguments(p)
    EngineConfig.add_arguments(p)  # the engine's own options: --model, --device, --max-num-seqs, ...


def run(args: argparse.Namespace) -> int:
    from nanoserve import bench_prefix, bench_spec

    if args.quick:
        for key, value in (QUICK | bench_prefix.QUICK | bench_spec.QUICK).items():
            setattr(args, key, value)
    args.prompt_range = args.output_range = tuple(args.lengths)
    args.serving_output_range = tuple(args.output_len)
    todo = ["latency", "throughput", "serving"] if args.what == "all" else [args.what]
    if args.runs is not None and (args.check or "latency" not in todo):
        raise ValueError(f"--runs sets the timed runs of latency, not of {'--check' if args.check else args.what}")
    if args.check:
        from nanoserve.capstone import TRACKS, run_check

        return run_check(args, TRACKS[args.check])
    args.runs = 5 if args.runs is None else args.runs
    if args.runs < 2:
        raise ValueError(f"--runs {args.runs}: at least 2 (the first run compiles kernels and is not counted)")
    if args.data_parallel_size > 1 and set(todo) - {"throughput", "serving"}:
        raise ValueError(f"--data-parallel-size applies to throughput and serving, not to {args.what}: one replica "
                         "is what latency, prefix and spec measure")
    for what in todo:
        {"latency": bench_latency, "throughput": bench_throughput, "serving": bench_serving,
         "prefix": bench_prefix.bench_prefix, "spec": bench_spec.bench_spec}[what](args)
    return 0
