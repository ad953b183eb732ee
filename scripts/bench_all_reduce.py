"""Week 20: NCCL's all-reduce against the one-shot all-reduce over peer-to-peer memory
(`nanoserve.model.tensor_parallel.OneShotAllReduce`), per message size, eagerly and inside a
CUDA graph, on the GPUs of one host. It picks where the one-shot path stops paying
(`ONE_SHOT_MAX_BYTES` in nanoserve/engine/device.py).

    python scripts/bench_all_reduce.py --gpus 2 --out docs/bench/week20/all_reduce.json

Each figure is rank 0's time per call: `calls` back-to-back all-reduces (captured once as one
graph, or launched eagerly), timed with CUDA events over `repeats` rounds; the median round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]


def time_calls(fn, x, calls: int, repeats: int, graph: bool) -> float:
    """Median seconds per call of `fn(x)`, `calls` at a time."""
    def burst():
        for _ in range(calls):
            fn(x)

    for _ in range(3):
        burst()  # warm-up (and the lazy NCCL set-up) before any capture
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            burst()
        run = g.replay
    else:
        run = burst
    rounds = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(rounds)


def rank_main(rank: int, size: int, port: int, out: str | None, calls: int, repeats: int) -> None:
    from nanoserve.model.tensor_parallel import Group, OneShotAllReduce

    torch.cuda.set_device(rank)
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)  # no NVLink multicast, as the engine (`init_group`)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=torch.device("cuda", rank))
    group = Group(rank, size, dist.group.WORLD, None)
    one_shot = OneShotAllReduce(group, torch.bfloat16, f"cuda:{rank}", max(SIZES))
    rows = []
    for nbytes in SIZES:
        x = torch.full((nbytes // 2,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        total = size * (size + 1) / 2
        assert torch.all(one_shot(x) == total), "the one-shot sum is wrong"
        check = x.clone()
        dist.all_reduce(check)
        assert torch.all(check == total), "NCCL's sum is wrong"
        row = dict(bytes=nbytes)
        for name, fn in (("nccl", lambda t: dist.all_reduce(t)), ("one_shot", one_shot)):
            for graph in (False, True):
                t = x.clone()
                row[f"{name}_{'graph' if graph else 'eager'}_us"] = 1e6 * time_calls(fn, t, calls, repeats, graph)
        rows.append(row)
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"{size} x {name}, bf16, µs per call (median of {repeats} rounds of {calls} calls)")
        print(f"{'bytes':>9} {'NCCL eager':>11} {'NCCL graph':>11} {'1-shot eager':>13} {'1-shot graph':>13}")
        for r in rows:
            print(f"{r['bytes']:>9} {r['nccl_eager_us']:>11.1f} {r['nccl_graph_us']:>11.1f} "
                  f"{r['one_shot_eager_us']:>13.1f} {r['one_shot_graph_us']:>13.1f}")
        if out:
            os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
            with open(out, "w") as f:
                json.dump(dict(gpus=size, device=name, torch=torch.__version__, rows=rows), f, indent=1)
    del one_shot
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--calls", type=int, default=64, help="all-reduces per timed round (a decode step of the 8B shape has 64)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} GPUs, this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args.gpus, port, args.out, args.calls, args.repeats),
                                nprocs=args.gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
