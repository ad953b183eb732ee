"""Offline throughput of the engine: static vs continuous batching, with preemption counts.

    python scripts/bench_throughput.py --model /tmp/llama-3.2-1b-random --out docs/bench

The workload: N requests (default 256) whose prompt and output lengths are drawn uniformly from
[100, 1024], random token ids, EOS ignored so every request produces exactly its output length,
all submitted at once. For each configuration it reports output tokens/s, wall time, engine
steps and preemptions, and writes a JSON file.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoserve.bench.common import save_result, throughput_workload
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams

CONFIGS = {
    # name: (policy, max_num_seqs, kv cache memory in GiB or None for the default)
    "static": ("static", 64, None),
    "continuous": ("continuous", 64, None),
    "continuous-small-pool": ("continuous", 64, 1.0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args()
    results = []
    llm = eng = None
    for name in args.configs.split(","):
        policy, max_seqs, kv_gib = CONFIGS[name]
        del llm, eng  # free the previous engine's KV pool before sizing the next one
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        llm = LLM(args.model, batching=policy, max_num_seqs=max_seqs,
                  kv_cache_memory=None if kv_gib is None else int(kv_gib * 2**30))
        eng = llm.engine
        prompts, lengths = throughput_workload(args.num_requests, eng.model.config.vocab_size, (100, 1024), (100, 1024))
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=8)] * 4, use_tqdm=False)  # warm-up
        steps0, pre0 = eng.num_steps, eng.scheduler.num_preemptions
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.token_ids) for o in outs)
        assert out_tokens == sum(p.max_tokens for p in params)
        row = dict(config=name, policy=policy, max_num_seqs=max_seqs, kv_blocks=eng.runner.cache.num_blocks,
                   block_size=eng.runner.cache.block_size, output_tokens=out_tokens,
                   prompt_tokens=sum(map(len, prompts)), seconds=elapsed, output_tok_s=out_tokens / elapsed,
                   steps=eng.num_steps - steps0, preemptions=eng.scheduler.num_preemptions - pre0,
                   backend=eng.attention_backend, dtype=str(eng.model.embed_tokens.weight.dtype))
        results.append(row)
        print(f"{name:>22}: {row['output_tok_s']:8.0f} output tok/s  {elapsed:6.1f} s  {row['steps']} steps  "
              f"{row['preemptions']} preemptions  ({row['kv_blocks']} KV blocks of {row['block_size']})", flush=True)
    save_result(args.out, "throughput", num_requests=args.num_requests, model=args.model, rows=results)


if __name__ == "__main__":
    main()
