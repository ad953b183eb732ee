"""Issue 33: the grouped int8/int4 product (nanoserve/kernels/quant_matmul.py) against bf16's
matrix product (cuBLAS through torch), on the projections of a model shape, per batch size.

    python scripts/bench_quant_matmul.py [--shape 1b|8b] [--rows 1,4,16,64,256] [--group 128]

Each figure: the median over `--repeats` replays of a CUDA graph of `--calls` back-to-back calls,
timed with CUDA events, in µs per call (a graph, as the engine runs them: launching from Python
would time the launch, not the kernel), and the weight bytes read per µs (GB/s).

--sweep: for each projection and batch size, every block configuration of SWEEP timed the same way,
the best printed (the numbers `quant_matmul`'s GEMV_BLOCKS, THIN and WIDE come from).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from nanoserve.kernels.quant_matmul import quant_matmul
from nanoserve.model.quantized import QuantizedLinear

SHAPES = {  # (name, inputs, outputs) of one decoder layer's projections
    "1b": [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)],
    "8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
}


SWEEP = {  # rows up to -> block configurations tried: (BLOCK_N, BLOCK_K, warps) for the GEMV, else
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    4: [(4, 1024, 4), (2, 1024, 4), (8, 512, 4), (4, 512, 4), (8, 1024, 8), (16, 256, 4), (2, 2048, 4)],
    16: [(16, 16, 512, 4, 3), (16, 32, 256, 4, 3), (16, 16, 256, 4, 4), (16, 64, 128, 4, 3), (16, 32, 512, 8, 3),
         (16, 16, 1024, 4, 2)],
    64: [(32, 32, 256, 4, 3), (64, 64, 128, 4, 3), (32, 64, 128, 4, 4), (64, 32, 256, 4, 3), (16, 32, 256, 4, 3)],
    None: [(64, 64, 128, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4)],
}


def timed(fn, calls: int, repeats: int) -> float:
    """Median µs per call, `calls` calls captured in one CUDA graph and replayed `repeats` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def sweep(args) -> None:
    print(f"{'layer':>8} {'rows':>5} {'bits':>4} {'bf16 µs':>8}  best µs  config (then the others)")
    for name, k, n in SHAPES[args.shape]:
        dense = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        for bits in (8, 4):
            layer = QuantizedLinear.from_linear(dense, bits, args.group).cuda()
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                configs = next(v for limit, v in SWEEP.items() if limit is None or m <= limit)
                us = {c: timed(lambda c=c: quant_matmul(x, layer, c), args.calls, args.repeats) for c in configs}
                order = sorted(us, key=us.get)
                base = timed(lambda: dense(x), args.calls, args.repeats)
                print(f"{name:>8} {m:>5} {bits:>4} {base:8.1f} {us[order[0]]:8.1f}  {order[0]}  "
                      + "  ".join(f"{c}:{us[c]:.1f}" for c in order[1:]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sweep", action="store_true", help="try every block configuration of SWEEP")
    args = p.parse_args()
    assert torch.cuda.is_available(), "this benchmark times CUDA kernels: run it on a GPU"
    torch.manual_seed(0)
    if args.sweep:
        return sweep(args)
    print(f"{'layer':>8} {'rows':>5} {'bf16 µs':>9} {'int8 µs':>9} {'int4 µs':>9} {'bf16 GB/s':>10} "
          f"{'int8 GB/s':>10} {'int4 GB/s':>10}")
    for name, k, n in SHAPES[args.shape]:
        dense = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        quantized = {bits: QuantizedLinear.from_linear(dense, bits, args.group).cuda() for bits in (8, 4)}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = {"bf16": timed(lambda: dense(x), args.calls, args.repeats)}
            for bits, layer in quantized.items():
                us[f"int{bits}"] = timed(lambda: quant_matmul(x, layer), args.calls, args.repeats)
            nbytes = {"bf16": n * k * 2, "int8": quantized[8].weight_bytes(), "int4": quantized[4].weight_bytes()}
            print(f"{name:>8} {m:>5} " + " ".join(f"{us[t]:9.1f}" for t in ("bf16", "int8", "int4")) + " "
                  + " ".join(f"{nbytes[t] / us[t] / 1e3:10.0f}" for t in ("bf16", "int8", "int4")), flush=True)


if __name__ == "__main__":
    main()
