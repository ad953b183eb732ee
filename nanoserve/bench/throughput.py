"""`bench throughput`: many requests offline, nanoserve against HF (and data parallelism)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.bench.common import (
    free_gpu,
    hf_model,
    print_table,
    kv_pool,
    save_and_plot,
    sync_device,
    throughput_workload,
    vocab_size_of,
)
from nanoserve.bench.latency import profile_steps, step_breakdown
from nanoserve.model.moe import reset_expert_load


def print_bubble(engine) -> dict | None:
    """Week 20: each pipeline stage's idle share of the timed run against the schedule's
    (P - 1) / (M + P - 1); returns the figures (None with one stage)."""
    bubble = engine.pipeline_stats()
    if bubble is not None:
        print(f"pipeline: {bubble['num_stages']} stages, {bubble['micro_batches']} micro-batches a step, up to "
              f"{bubble.get('steps_in_flight', 1)} steps in flight; idle share "
              f"per stage {', '.join(f'{f:.1%}' for f in bubble['idle_fraction'])} (mean "
              f"{bubble['mean_idle_fraction']:.1%}) against the schedule's {bubble['scheduled_idle_fraction']:.1%}")
    return bubble


def print_expert_load(engine) -> dict | None:
    """Week 24: how the timed run's token-expert pairs spread over the experts of a mixture (summed over
    its MoE layers), as a text histogram, and each layer's busiest expert against an even spread;
    returns the figures (None for a dense model)."""
    load = engine.expert_load()
    if load is None:
        return None
    totals = [sum(column) for column in zip(*load.values())]
    even = sum(totals) / len(totals)
    imbalance = {layer: max(c) * len(c) / sum(c) for layer, c in load.items() if sum(c)}
    print(f"expert load over {len(load)} MoE layers: token-expert pairs per expert (an even spread: {even:,.0f} each)")
    for expert, n in enumerate(totals):
        print(f"  expert {expert:3d} {'#' * round(40 * n / max(max(totals), 1)):<40} {n:,}")
    if imbalance:
        print(f"busiest expert / even spread, per layer: mean {sum(imbalance.values()) / len(imbalance):.2f}, "
              f"worst {max(imbalance.values()):.2f} (layer {max(imbalance, key=imbalance.get)})")
    return dict(per_expert=totals, per_layer=load, busiest_over_even=imbalance)


def profile_full_batch(engine, prompts: list, params: list, device: str) -> None:
    """`--profile`: a full batch, every request admitted and decoding; where its steps' time goes."""
    ids = [engine.add_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
    if device.startswith("cuda"):
        print("the first step (a prefill):")
        profile_steps(engine, 1)
    while engine.scheduler.waiting or any(s.num_computed < len(s.prompt_ids) for s in engine.scheduler.running):
        engine.step()
    print(f"decode steps with {len(engine.scheduler.running)} sequences running:")
    print("per decode step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in step_breakdown(engine, 20).items()))
    if device.startswith("cuda"):
        profile_steps(engine, 10)
    for i in ids:
        engine.abort(i)


def bench_throughput(args) -> dict:
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import LLM
    from nanoserve.model.loader import resolve_model_dir
    from nanoserve.sampling.params import SamplingParams

    model_dir = resolve_model_dir(args.model)
    prompts, lengths = throughput_workload(args.num_requests, vocab_size_of(model_dir), args.prompt_range, args.output_range)
    if args.data_parallel_size > 1:  # week 18: replicas, each with its share of the prompts
        return throughput_data_parallel(args, model_dir, prompts, lengths)
    llm = LLM(replace(EngineConfig.from_args(args), model=model_dir, trace=True))
    engine = llm.engine
    device, dtype = str(engine.runner.device), engine.model.embed_tokens.weight.dtype
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8)] * 4, use_tqdm=False)  # warm-up
    if args.profile:
        profile_full_batch(engine, prompts, params, device)
    steps0 = engine.num_steps
    engine.trace.clear()
    if engine.pipeline_stats() is not None:  # week 20: count the bubble of the timed run only
        engine.runner.reset_bubble_stats()
    reset_expert_load(engine.model)  # week 24: the timed run's routing only
    sync_device(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    sync_device(device)
    elapsed = time.perf_counter() - start
    # Where the wall time went: steps that prefill some prompt (eager), pure decode steps (graphs)
    prefill = sum(r.end - r.start for r in engine.trace if max(r.num_new_tokens) > 1)
    decode = sum(r.end - r.start for r in engine.trace if max(r.num_new_tokens) == 1)
    num_prefill = sum(max(r.num_new_tokens) > 1 for r in engine.trace)
    split = dict(prefill_steps=num_prefill, prefill_step_seconds=prefill, decode_step_seconds=decode,
                 other_seconds=elapsed - prefill - decode)
    print(f"{num_prefill} steps with a prefill: {prefill:.2f} s; {len(engine.trace) - num_prefill} decode steps: "
          f"{decode:.2f} s; outside steps: {elapsed - prefill - decode:.2f} s")
    bubble = print_bubble(engine)
    load = print_expert_load(engine)
    out_tokens = sum(len(o.token_ids) for o in outs)
    assert out_tokens == sum(lengths), "every request must produce exactly its output length"
    rows = [dict(engine="nanoserve", output_tok_s=out_tokens / elapsed, seconds=elapsed,
                 steps=engine.num_steps - steps0, preemptions=engine.scheduler.num_preemptions)]
    if bubble is not None:
        rows[0]["pipeline_bubble"] = bubble
    if load is not None:
        rows[0]["expert_load"] = load
    pool = kv_pool(engine)  # issue 33: what --kv-cache-dtype fp8 changes
    llm.close()  # the other ranks stop now, not at some later garbage collection
    del llm, engine
    free_gpu()
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
                  **pool, dtype=str(dtype), time_split=split, rows=rows)

    def draw(ax):
        ax.barh([r["engine"] for r in rows], [r["output_tok_s"] for r in rows], color=["tab:blue", "tab:gray"][: len(rows)])
        ax.set_xlabel("output tokens/s")

    save_and_plot(args, "throughput", result, draw)
    return result


def throughput_data_parallel(args, model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> dict:
    """Week 18: the same workload over --data-parallel-size replicas (processes on GPUs of their
    own: `nanoserve.server.data_parallel.generate_data_parallel`), timed from all loaded to all done."""
    from nanoserve.engine.config import EngineConfig, default_device
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.server.data_parallel import generate_data_parallel

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

    save_and_plot(args, "throughput", result, draw)
    return result


def hf_cache_config(prompts: list[list[int]], lengths: list[int], device: str):
    """HF's continuous-batching cache settings. On a GPU, HF's own (its pool takes a share of the
    GPU's free memory, as it would for any user). On the CPU that share is of the machine's RAM: 14 GB
    for the tiny model on a 24 GiB machine, beside the test suite. There the pool gets what the whole
    workload can hold at once instead: each request's prompt and output, in whole pages."""
    from transformers.generation import ContinuousBatchingConfig

    if device.startswith("cuda"):
        return None
    page = 256
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(prompts, lengths))
    return ContinuousBatchingConfig(page_size=page, num_blocks=blocks + 1)


def hf_throughput(model_dir: Path, prompts: list[list[int]], lengths: list[int], dtype: torch.dtype,
                  device: str, time_limit: float | None = None) -> tuple[float, int]:
    """(seconds, requests finished) for HF transformers' continuous batching (the manager behind
    `generate_batch`) on the workload. `generate_batch` itself takes one max_new_tokens for all
    requests; its manager takes one per request, which is the same workload as ours. With a
    time limit, it stops there and reports how many requests had finished."""
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    hf = hf_model(model_dir, dtype, device)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=0)
    cache = hf_cache_config(prompts, lengths, device)
    generated = finished = 0
    with torch.no_grad():
        hf.generate_batch(inputs=[p[:16] for p in prompts[:4]], generation_config=config,  # warm-up
                          continuous_batching_config=cache, max_new_tokens=8)
        manager = hf.init_continuous_batching(generation_config=config, continuous_batching_config=cache)
        manager.start()
        try:
            sync_device(device)
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
            sync_device(device)
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True)
    if finished == len(prompts) and generated != sum(lengths):
        raise RuntimeError(f"HF generated {generated} tokens, the workload asks for {sum(lengths)}")
    del hf, manager
    free_gpu()
    return seconds, finished

