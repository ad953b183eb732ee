"""Week 18 on one GPU: what each data-parallel replica's share of an offline workload takes.

    python scripts/bench_dp_share.py --model /tmp/llama1b --sizes 2 4

`nanoserve bench throughput --data-parallel-size N` hands replica i the prompts i, i + N, ... and
times from every replica loaded to the last one done; each replica has a GPU of its own. With one
GPU, this times the same shares one after the other, each through its own engine: the whole
workload (N = 1), then each of the N shares. On N GPUs the run would take as long as the slowest
share, so `whole / slowest share` is the speed-up DP = N can reach with nothing else in the way
(the replicas share nothing but the host's CPUs, which this does not load as N processes would).
Each share also reports how many of its steps carried prompt tokens: without chunked prefill a
request admitted mid-run gets a step of its own.

The workload is `nanoserve bench throughput`'s: --num-requests prompts with lengths uniform in
--prompt-len, outputs uniform in --output-len, EOS ignored, random token ids (seed 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date

import torch

from nanoserve.bench.common import free_gpu, throughput_workload
from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams


def timed(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.engine.trace.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outs) == sum(lengths), "every request must produce its output length"
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[2])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--repeats", type=int, default=3, help="timings of each share (the median is kept)")
    p.add_argument("--enable-chunked-prefill", action="store_true", help="week 15's scheduling in every engine")
    p.add_argument("--out")
    args = p.parse_args()
    llm = LLM(args.model, enable_chunked_prefill=args.enable_chunked_prefill, trace=True)
    vocab = llm.engine.model.config.vocab_size
    prompts, lengths = throughput_workload(args.num_requests, vocab, tuple(args.prompt_len), tuple(args.output_len))
    timed(llm, prompts, [2] * len(prompts))  # warm up: every prompt once (kernels compiled for its shapes)
    timed(llm, prompts[: len(prompts) // 2], lengths[: len(prompts) // 2])  # and a decode-heavy run

    def share(i: int, n: int) -> dict:
        times = [timed(llm, prompts[i::n], lengths[i::n]) for _ in range(args.repeats)]
        trace = llm.engine.trace  # the last run's steps: how many carried prompt tokens
        return dict(replica=i, requests=len(prompts[i::n]), output_tokens=sum(lengths[i::n]), steps=len(trace),
                    steps_with_prompts=sum(1 for r in trace if max(r.num_new_tokens) > 1),
                    seconds=statistics.median(times), min_seconds=min(times), max_seconds=max(times))

    whole = share(0, 1)
    rows = [dict(dp_size=1, shares=[whole], seconds=whole["seconds"],
                 output_tok_s=whole["output_tokens"] / whole["seconds"], speedup=1.0)]
    for n in args.sizes:
        shares = [share(i, n) for i in range(n)]
        slowest = max(s["seconds"] for s in shares)
        rows.append(dict(dp_size=n, shares=shares, seconds=slowest, output_tok_s=sum(lengths) / slowest,
                         speedup=whole["seconds"] / slowest))
    print(f"{'DP':>3} {'slowest share (s)':>18} {'output tok/s':>13} {'speed-up':>9}")
    for r in rows:
        print(f"{r['dp_size']:>3} {r['seconds']:18.2f} {r['output_tok_s']:13,.0f} {r['speedup']:8.2f}x   shares: "
              + ", ".join(f"{s['seconds']:.2f} s ({s['min_seconds']:.2f}-{s['max_seconds']:.2f}; "
                           f"{s['steps_with_prompts']} of {s['steps']} steps with prompts)" for s in r["shares"]))
    llm.close()
    free_gpu()
    if args.out:
        device = str(llm.engine.runner.device)
        info = dict(what="each data-parallel replica's share timed alone on one device (scripts/bench_dp_share.py)",
                    model=args.model, device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                    torch=torch.__version__, date=str(date.today()), num_requests=args.num_requests,
                    prompt_len=args.prompt_len, output_len=args.output_len, repeats=args.repeats,
                    enable_chunked_prefill=args.enable_chunked_prefill, rows=rows)
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
