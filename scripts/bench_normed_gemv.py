"""Issue 39: the normed qkv product (add + RMSNorm in the GEMV's prologue) against what it replaces.

    python scripts/bench_normed_gemv.py [--shape 1b] [--sweep]      (a CUDA GPU and Triton)

At batch 1 the norm before a layer's qkv product can run in the product's own launch
(`nanoserve/kernels/normed_gemv.py`): one launch fewer, but the product is then a Triton GEMV and
not cuBLAS's. This times both in CUDA graphs of 50 calls (the launch's cost as the engine pays
it), bf16, for the qkv and gate_up shapes: `add_rmsnorm` + `F.linear` against `normed_gemv`, and
`add_rmsnorm` + `gate_up_silu_row` against `normed_gate_up_silu`; with --sweep, every block
configuration of the normed qkv product, the fastest first. It also times o_proj and down_proj
through cuBLAS against `row_gemv` (switch `row-gemv`) and every block configuration of
those two with --sweep-small, printing `BEST <name> (BLOCK_N, BLOCK_K, warps)`. Prints µs a call (median of the
repeats) and the weights' bandwidth. Every call reads a weight that the calls just before it did not
touch (copies cycled through, 256 MB of them), as the model's layers do: one weight called again and
again stays in the 50 MB L2 cache and reports more bandwidth than the memory has.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.kernels.fused import add_rmsnorm
from nanoserve.kernels.normed_gemv import (DOWN_GEMV_BLOCKS, NORMED_GEMV_BLOCKS, O_GEMV_BLOCKS, gate_up_silu_row,
                                          normed_gate_up_silu, normed_gemv, row_gemv)
from nanoserve.model.layers import RMSNorm

from bench_quant_matmul import timed as graph_time  # (scripts/ is on the path when run as a script)

SHAPES = {"1b": (2048, 3072, 8192), "8b": (4096, 6144, 14336)}  # hidden, q + 2 kv, intermediate


def cold(make, nbytes: int) -> Callable[[], object]:
    """`make()` builds one weight (or module); this keeps enough of them that a graph's calls, cycling
    through them, read more bytes than the 50 MB L2 cache holds, as the model's 16 layers do. A call
    that read the same weight again would find it in L2 and report a bandwidth above the memory's."""
    items = [make() for _ in range(max(2, -(-256 * 2**20 // nbytes)))]
    return itertools.cycle(items).__next__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="every block configuration of the normed qkv product")
    ap.add_argument("--sweep-small", action="store_true", help="every block configuration of row_gemv for o and down")
    args = ap.parse_args()
    hidden, qkv, inter = SHAPES[args.shape]
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x, residual = (torch.randn(1, hidden, device=dev, dtype=dt, generator=g) for _ in range(2))
    norm = RMSNorm(hidden, 1e-5).to(dev, dt)
    linear = lambda k, n: torch.nn.Linear(k, n, bias=False).to(dev, dt)  # noqa: E731
    qkv_bytes, gate_up_bytes = qkv * hidden * 2, 2 * inter * hidden * 2
    proj = cold(lambda: linear(hidden, qkv), qkv_bytes)
    w_gate_up = cold(lambda: torch.randn(2 * inter, hidden, device=dev, dtype=dt, generator=g) * 0.02, gate_up_bytes)
    timed = lambda fn: graph_time(fn, args.calls, args.repeats)  # noqa: E731
    gbps = lambda nbytes, us: nbytes / us / 1e3  # noqa: E731

    plain_norm = timed(lambda: add_rmsnorm(x, residual, norm.weight, norm.eps))
    plain_qkv = timed(lambda: F.linear(add_rmsnorm(x, residual, norm.weight, norm.eps)[0], proj().weight))
    fused_qkv = timed(lambda: normed_gemv(x, residual, norm, proj()))
    plain_gu = timed(lambda: gate_up_silu_row(add_rmsnorm(x, residual, norm.weight, norm.eps)[0], w_gate_up()))
    fused_gu = timed(lambda: normed_gate_up_silu(x, residual, norm, w_gate_up()))
    print(f"shape {args.shape}: hidden {hidden}, qkv {qkv}, intermediate {inter}; µs a call in CUDA graphs,"
          " each call reading a weight that is not in L2")
    print(f"  add_rmsnorm alone                         {plain_norm:7.2f}")
    print(f"  add_rmsnorm + cuBLAS qkv                  {plain_qkv:7.2f}   ({gbps(qkv_bytes, plain_qkv):6.0f} GB/s of weights)")
    print(f"  normed_gemv qkv {str(NORMED_GEMV_BLOCKS):14s}            {fused_qkv:7.2f}   ({gbps(qkv_bytes, fused_qkv):6.0f} GB/s)")
    print(f"  add_rmsnorm + gate_up_silu_row            {plain_gu:7.2f}   ({gbps(gate_up_bytes, plain_gu):6.0f} GB/s)")
    print(f"  normed_gate_up_silu                       {fused_gu:7.2f}   ({gbps(gate_up_bytes, fused_gu):6.0f} GB/s)")
    h_o = torch.randn(1, hidden, device=dev, dtype=dt, generator=g)  # (q heads x head_dim = hidden here)
    h_down = torch.randn(1, inter, device=dev, dtype=dt, generator=g)
    small = {"o": (cold(lambda: linear(hidden, hidden), hidden * hidden * 2), h_o, O_GEMV_BLOCKS, hidden * hidden * 2),
             "down": (cold(lambda: linear(inter, hidden), inter * hidden * 2), h_down, DOWN_GEMV_BLOCKS,
                      inter * hidden * 2)}
    for name, (next_proj, h, cfg, nbytes) in small.items():
        cublas = timed(lambda: F.linear(h, next_proj().weight))
        ours = timed(lambda: row_gemv(h, next_proj(), cfg))
        print(f"  cuBLAS {name:4s}                               {cublas:7.2f}   ({gbps(nbytes, cublas):6.0f} GB/s)")
        print(f"  row_gemv {name:4s} {str(cfg):14s}           {ours:7.2f}   ({gbps(nbytes, ours):6.0f} GB/s)")
    if args.sweep_small:
        for name, (next_proj, h, _, nbytes) in small.items():
            rows = []
            for cfg in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096), (2, 4, 8)):
                if cfg[1] <= h.shape[1] and cfg[0] * cfg[1] <= 16384:
                    rows.append((timed(lambda: row_gemv(h, next_proj(), cfg)), cfg))
            rows.sort()
            print(f"row_gemv {name}, every configuration (BLOCK_N, BLOCK_K, warps), fastest first:")
            for us, cfg in rows[:6]:
                print(f"  {str(cfg):16s} {us:7.2f} µs   ({gbps(nbytes, us):6.0f} GB/s)")
            print(f"BEST {name} {rows[0][1]}")
    if args.sweep:
        rows = []
        for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
            if block_k > hidden:
                continue
            cfg = (block_n, block_k, warps)
            rows.append((timed(lambda: normed_gemv(x, residual, norm, proj(), config=cfg)), cfg))
        rows.sort()
        print("normed qkv, every configuration (BLOCK_N, BLOCK_K, warps), fastest first:")
        for us, cfg in rows[:12]:
            print(f"  {str(cfg):16s} {us:7.2f} µs   ({gbps(qkv_bytes, us):6.0f} GB/s)")


if __name__ == "__main__":
    main()
