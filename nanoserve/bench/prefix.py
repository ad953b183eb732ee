"""Week 14's benchmark: what prefix caching saves, and what it costs when nothing is shared.

    nanoserve bench prefix --model DIR [--quick]

Three offline workloads, each run with prefix caching off and on, one engine per run and every
run in a fresh process, off and on alternated, --repeats times each (3; nanoserve/bench/alternate.py
says why): the table gives the median of the runs and their range.
- shared prefixes: a few long system prompts, many short questions after each, all at once;
- multi-turn chats: conversations that resend their whole history every turn (the next turn
  is sent when the previous answer is complete);
- random prompts (the throughput benchmark's workload): nothing to share, so caching can only
  cost (hashing, bookkeeping).
For each: prefilled tokens (every token run through the model that was not a decode step:
prompts, recomputation after preemption), the hit rate, output tokens/s, and the time to first
token (p50/p99, from submission: in an offline run it includes queueing).
"""

from __future__ import annotations

import random
from dataclasses import replace

from nanoserve.bench.alternate import Summary, as_json, describe, repeats_of, run_alternated, summarize, with_spread
from nanoserve.bench.common import (
    free_gpu,
    print_table,
    save_and_plot,
    sync_device,
    throughput_workload,
    vocab_size_of,
)
from nanoserve.scheduler.simulator import percentile

WORKLOADS = ("shared-prefix", "multi-turn", "random")


def shared_prefix_workload(vocab: int, num_systems: int, per_system: int, system_len: tuple[int, int],
                           question_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0):
    """num_systems system prompts x per_system questions, shuffled -> (prompts, output lengths)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(*system_len))] for _ in range(num_systems)]
    prompts = [s + [rng.randrange(vocab) for _ in range(rng.randint(*question_len))]
               for s in systems for _ in range(per_system)]
    rng.shuffle(prompts)
    return prompts, [rng.randint(*output_len) for _ in prompts]


def run_offline(engine, prompts: list[list[int]], lengths: list[int]) -> dict:
    """All requests submitted at once, run to the end."""
    from nanoserve.sampling.params import SamplingParams

    seqs = []
    for prompt, n in zip(prompts, lengths):
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), stream=False)
        seqs.append(engine.sequences[rid])
    while engine.has_unfinished():
        engine.step()
    return dict(seqs=seqs)


def run_multi_turn(engine, vocab: int, conversations: int, turns: int, first_len: tuple[int, int],
                   message_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0) -> dict:
    """Each conversation sends its next turn (history + answer + a new message) once its last
    answer is complete."""
    from nanoserve.sampling.params import SamplingParams

    rng = random.Random(seed)
    history = [[rng.randrange(vocab) for _ in range(rng.randint(*first_len))] for _ in range(conversations)]
    turns_left = [turns] * conversations
    owner, seqs = {}, []

    def send(c: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=rng.randint(*output_len), ignore_eos=True)
        rid = engine.add_request(history[c], params, stream=False)
        owner[rid] = c
        seqs.append(engine.sequences[rid])
        turns_left[c] -= 1

    for c in range(conversations):
        send(c)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                c = owner.pop(out.request_id)
                if turns_left[c]:
                    history[c] = history[c] + out.token_ids + [rng.randrange(vocab)
                                                               for _ in range(rng.randint(*message_len))]
                    send(c)
    return dict(seqs=seqs)


def measure(config, workload: str, args, vocab: int) -> dict:
    """One engine, one workload: one run of a row of the table (bench_prefix calls it in a fresh
    process for every run)."""
    import time

    from nanoserve.engine.engine import Engine

    engine = Engine(config)
    device = str(engine.runner.device)
    # Not timed: compiles this process's kernels (a fresh process has none), so that the run times
    # the workload and not Triton or torch compiling.
    warm, _ = throughput_workload(4, vocab, (8, 32), (8, 8), seed=99)
    run_offline(engine, warm, [8] * 4)
    before_tokens = engine.scheduler.num_scheduled_tokens
    before_stats = engine.prefix_cache_stats()
    sync_device(device)
    start = time.perf_counter()
    if workload == "shared-prefix":
        prompts, lengths = shared_prefix_workload(vocab, args.num_systems, args.per_system, args.system_len,
                                                  args.question_len, args.prefix_output_len)
        seqs = run_offline(engine, prompts, lengths)["seqs"]
    elif workload == "multi-turn":
        seqs = run_multi_turn(engine, vocab, args.conversations, args.turns, args.first_len, args.question_len,
                              args.prefix_output_len)["seqs"]
    else:
        prompts, lengths = throughput_workload(args.num_requests, vocab, args.prompt_range, args.output_range)
        seqs = run_offline(engine, prompts, lengths)["seqs"]
    sync_device(device)
    elapsed = time.perf_counter() - start
    out_tokens = sum(s.num_output_tokens for s in seqs)
    scheduled = engine.scheduler.num_scheduled_tokens - before_tokens
    prefilled = scheduled - (out_tokens - len(seqs))  # every output token but the first comes from a decode row
    stats = engine.prefix_cache_stats()
    hit = None
    if stats is not None:
        looked = stats["lookup_tokens"] - before_stats["lookup_tokens"]
        hit = (stats["hit_tokens"] - before_stats["hit_tokens"]) / looked if looked else 0.0
    ttft = [s.ttft for s in seqs]
    row = dict(workload=workload, caching=config.enable_prefix_caching, requests=len(seqs),
               prompt_tokens=sum(s.prompt_len for s in seqs), prefilled_tokens=prefilled, hit_rate=hit,
               output_tok_s=out_tokens / elapsed, seconds=elapsed, ttft_p50_ms=1e3 * percentile(ttft, 50),
               ttft_p99_ms=1e3 * percentile(ttft, 99), preemptions=engine.scheduler.num_preemptions,
               evictions=stats["evictions"] - before_stats["evictions"] if stats else None)
    del engine
    free_gpu()
    return row


def bench_prefix(args) -> dict:
    from nanoserve.engine.config import EngineConfig
    from nanoserve.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    vocab = vocab_size_of(model_dir)
    base = replace(EngineConfig.from_args(args), model=model_dir, batching="continuous")
    sides = {"both": (True, False) if args.caching_first else (False, True), "on": (True,), "off": (False,)}
    repeats = repeats_of(args)
    rows, summaries = [], []
    for workload in args.workloads.split(","):
        # Each run of each side in a fresh process, the sides alternated (nanoserve/bench/alternate.py
        # says why): two engines in one process ran at speeds that depended on their order.
        configs = {f"caching {'on' if c else 'off'}": (replace(base, enable_prefix_caching=c), workload, args, vocab)
                   for c in sides[args.caching]}
        runs = run_alternated(measure, configs, repeats, args.run_timeout, what=f"bench prefix, {workload}")
        for label in ("caching off", "caching on"):
            if label in runs:
                summaries.append(summarize(runs[label]))
                rows.append(as_json(summaries[-1]))
    for on, off in zip(rows[1::2], rows[::2]) if args.caching == "both" else ():
        # the ratios of the medians
        on["prefill_saving"] = off["prefilled_tokens"] / max(1, on["prefilled_tokens"])
        on["ttft_p50_speedup"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        on["throughput_vs_off"] = on["output_tok_s"] / off["output_tok_s"]
    print_prefix_table(rows, summaries, repeats)
    result = dict(model=str(args.model), repeats=repeats, num_systems=args.num_systems, per_system=args.per_system,
                  system_len=args.system_len, question_len=args.question_len, output_len=args.prefix_output_len,
                  conversations=args.conversations, turns=args.turns, first_len=args.first_len,
                  random_requests=args.num_requests, random_prompt_len=args.prompt_range,
                  random_output_len=args.output_range, rows=rows)

    def draw(ax):
        labels = [f"{r['workload']}\n{'on' if r['caching'] else 'off'}" for r in rows]
        ax.bar(labels, [r["prefilled_tokens"] for r in rows], color=["tab:gray", "tab:blue"] * 3)
        ax.set_ylabel("prefilled tokens")

    save_and_plot(args, "prefix_caching", result, draw)
    return result


def print_prefix_table(rows: list[dict], summaries: list[Summary], repeats: int) -> None:
    """The table: each measured cell the median of the runs with their range; the ratios are
    those of the medians."""
    spread_columns = [("prefilled_tokens", ",.0f"), ("hit_rate", ".3f"), ("output_tok_s", ",.0f"),
                      ("ttft_p50_ms", ",.1f"), ("ttft_p99_ms", ",.1f")]
    cells = [dict(row, **{key: with_spread(s, key, fmt) for key, fmt in spread_columns})
             for row, s in zip(rows, summaries)]
    print_table(f"prefix caching, off and on: {describe(repeats)}", cells,
                [("workload", "workload", ""), ("caching", "caching", ""), ("prefilled_tokens", "prefilled", ""),
                 ("hit_rate", "hit rate", ""), ("output_tok_s", "output tok/s", ""),
                 ("ttft_p50_ms", "TTFT p50 ms", ""), ("ttft_p99_ms", "TTFT p99 ms", ""),
                 ("prefill_saving", "prefill ÷", ".2f"), ("ttft_p50_speedup", "TTFT p50 ÷", ".2f"),
                 ("throughput_vs_off", "tok/s vs off", ".3f")])


def add_arguments(p) -> None:
    from nanoserve.bench.common import int_pair

    g = p.add_argument_group("prefix (week 14)")
    g.add_argument("--num-systems", type=int, default=8, help="prefix: distinct system prompts (default: %(default)s)")
    g.add_argument("--per-system", type=int, default=32, help="prefix: questions per system prompt (default: %(default)s)")
    g.add_argument("--system-len", type=int_pair, default=(1000, 2000),
                   help="prefix: system prompt lengths LOW,HIGH (default: 1000,2000)")
    g.add_argument("--question-len", type=int_pair, default=(20, 200),
                   help="prefix: question (and later chat message) lengths LOW,HIGH (default: 20,200)")
    g.add_argument("--prefix-output-len", type=int_pair, default=(64, 256),
                   help="prefix: output lengths LOW,HIGH (default: 64,256)")
    g.add_argument("--conversations", type=int, default=32, help="prefix: multi-turn conversations (default: %(default)s)")
    g.add_argument("--turns", type=int, default=5, help="prefix: turns per conversation (default: %(default)s)")
    g.add_argument("--first-len", type=int_pair, default=(200, 800),
                   help="prefix: first message lengths LOW,HIGH (default: 200,800)")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help="prefix: which workloads, comma-separated (default: %(default)s)")
    g.add_argument("--caching-first", action="store_true",
                   help="prefix: alternate on, off, on, off, ... (default: off first)")
    g.add_argument("--caching", choices=["both", "on", "off"], default="both",
                   help="prefix: measure caching on and off (both, the default), or one side only")


QUICK = dict(num_systems=2, per_system=3, system_len=(20, 40), question_len=(2, 8), prefix_output_len=(4, 8),
             conversations=2, turns=3, first_len=(10, 20))
