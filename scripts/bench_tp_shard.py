"""Week 18 on one GPU: how long one tensor-parallel rank computes, with its collectives taken out.

    python scripts/bench_tp_shard.py --model /tmp/llama8b --sizes 1 2 --out shard.json

At TP = N every rank reads 1/N of each sharded weight and then waits for the collectives (two
all-reduces per layer, one for the embedding, an all-gather of the logits). With one GPU only the
first half can be measured, and this measures it: rank 0's shard of the model, cut by the same
`shard_model` the engine uses, decoding at batch 1 through the same engine (CUDA graphs, the plain
loop, as tensor parallelism runs), with a group whose collectives do nothing. Its step time is what
a TP = N step would take if communication were free, so

    measured TP = N step  -  this shard's step   =   what the collectives cost

once a machine with N GPUs measures the first figure. Before that, it says how much time the
collectives may take for a target to hold (`--target`). The shard's tokens are meaningless (no
partial sums are added); only its time is.

Printed and written (`--out`): per size, the weights one rank reads, the batch-1 decode speed
(median of runs 2..R, with min and max) and the GPU time of one captured decode step (median of 5
timings of 200 replays, with min and max); with `--profile`, that step's GPU time split between
the matrix products and the other kernels.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import date
from unittest import mock

import torch

import nanoserve.engine.engine as engine_module
import nanoserve.model.tensor_parallel as tensor_parallel
from nanoserve.bench.common import free_gpu, copy_bandwidth
from nanoserve.bench.latency import replay_ms
from nanoserve.engine.engine import Engine
from nanoserve.engine.config import EngineConfig
from nanoserve.model.tensor_parallel import Group
from nanoserve.sampling.params import SamplingParams


class NoCollectives(Group):
    """Rank `rank` of `size`, with collectives that return their input: one rank's compute alone."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


def shard_engine(config: EngineConfig, size: int) -> Engine:
    """An engine on one device running rank 0's shard of TP = `size` (the whole model for 1)."""
    if size == 1:
        return Engine(config)
    build = engine_module.build_device_side
    with mock.patch.object(engine_module, "build_device_side", lambda c, group=None: build(c, NoCollectives(0, size))), \
            mock.patch.object(tensor_parallel, "min_over_ranks", lambda group, value: value):
        return Engine(config)


MATMUL = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "gate_up_silu")  # kernel names of the products


def replay_profile(engine, reps: int = 20) -> dict:
    """Where one captured batch-1 decode step spends its GPU time: the matrix products (cuBLAS, and
    the fused gate_up kernel) against everything else (norms, RoPE, attention, the argmax...)."""
    from torch.profiler import ProfilerActivity, profile

    graph = engine.runner.graphs.graphs[1]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / reps, e.count / reps) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    products = [k for k in kernels if any(m in k[0].lower() for m in MATMUL)]
    others = [k for k in kernels if k not in products]
    top = sorted(kernels, key=lambda k: -k[1])[:10]
    return dict(matmul_us=sum(k[1] for k in products), matmul_kernels=sum(k[2] for k in products),
                other_us=sum(k[1] for k in others), other_kernels=sum(k[2] for k in others),
                top=[dict(name=n[:80], us=t, count=c) for n, t, c in top])


def measure(model: str, size: int, runs: int, prompt_len: int, new_tokens: int, device: str,
            profile: bool = False) -> dict:
    config = EngineConfig(model=model, device=device, async_scheduling=False)
    engine = shard_engine(config, size)
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    speeds = []
    for _ in range(runs):
        engine.add_request(prompt, params)
        times = []
        while engine.has_unfinished():
            if engine.step():
                times.append(time.perf_counter())
        speeds.append((new_tokens - 1) / (times[-1] - times[0]))
    replays = [replay_ms(engine) for _ in range(5)]
    cfg = engine.model.config
    row = dict(tp_size=size, rank=0, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
               intermediate=cfg.intermediate_size, layers=cfg.num_layers,
               weight_bytes=sum(p.numel() * p.element_size() for p in engine.model.parameters()),
               tok_s=statistics.median(speeds[1:]), min_tok_s=min(speeds[1:]), max_tok_s=max(speeds[1:]),
               runs=len(speeds) - 1)
    if replays[0] is not None:
        row.update(replay_ms=statistics.median(replays), min_replay_ms=min(replays), max_replay_ms=max(replays))
        if profile:
            row["profile"] = replay_profile(engine)
    engine.close()
    del engine
    free_gpu()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--target", type=float, default=1.6, help="the TP speed-up whose communication budget is printed")
    p.add_argument("--profile", action="store_true", help="also split one decode step's GPU time (CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    args = p.parse_args()
    rows = [measure(args.model, n, args.runs, args.prompt_len, args.new_tokens, args.device, args.profile)
            for n in args.sizes]
    base = rows[0] if rows[0]["tp_size"] == 1 else None
    print(f"{'TP':>3} {'heads':>5} {'kv':>3} {'inter':>6} {'GB/rank':>8} {'tok/s':>8} {'(min-max)':>15} "
          f"{'replay ms':>9}")
    for r in rows:
        replay = f"{r['replay_ms']:9.3f}" if "replay_ms" in r else f"{'-':>9}"
        print(f"{r['tp_size']:>3} {r['heads']:>5} {r['kv_heads']:>3} {r['intermediate']:>6} "
              f"{r['weight_bytes'] / 1e9:8.2f} {r['tok_s']:8.1f} {r['min_tok_s']:7.1f}-{r['max_tok_s']:<7.1f} {replay}")
        if "profile" in r:
            prof = r["profile"]
            print(f"    one step's kernels: products {prof['matmul_us']:.0f} us in {prof['matmul_kernels']:.0f} kernels, "
                  f"the rest {prof['other_us']:.0f} us in {prof['other_kernels']:.0f}")
        if base is not None and r is not base:
            # A TP = N step may take base_step / target in all; what the shard leaves is the collectives'.
            base_ms, shard_ms = 1e3 / base["tok_s"], 1e3 / r["tok_s"]
            budget = base_ms / args.target - shard_ms
            collectives = 2 * r["layers"] + 2  # 2 all-reduces a layer, the embedding's, the logits' all-gather
            r.update(compute_speedup=r["tok_s"] / base["tok_s"],
                     target=args.target, comm_budget_ms=budget, collectives=collectives,
                     comm_budget_us_each=1e3 * budget / collectives)
            print(f"    compute alone: {r['compute_speedup']:.2f}x TP=1; for {args.target}x the {collectives} collectives "
                  f"may take {budget:.3f} ms a step in all, {1e3 * budget / collectives:.1f} us each")
    if args.out:
        device = args.device
        info = dict(what="one TP rank's compute, collectives removed (scripts/bench_tp_shard.py)",
                    model=args.model, device=torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
                    copy_bandwidth_gbps=copy_bandwidth(device) / 1e9, torch=torch.__version__, date=str(date.today()),
                    prompt_len=args.prompt_len, new_tokens=args.new_tokens, rows=rows)
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
