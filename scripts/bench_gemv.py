"""Issue 20: is a hand-written GEMV faster than cuBLAS for the batch-1 projections?

    python scripts/bench_gemv.py            (a CUDA GPU and Triton)

At batch 1 every projection of the decode step is a matrix-vector product: the whole weight is
read once and each element used once, so the time should be the weight's bytes over the memory
bandwidth. The profile of `nanoserve bench latency --profile` (docs/benchmarks.md) has cuBLAS
reaching that for the large products but only ~55% of it for the qkv and o projections of the
Llama-3.2-1B shape. This times, for each projection shape, `F.linear` (cuBLAS) and a plain Triton
GEMV (each program computes BLOCK_N outputs, walking K in BLOCK_K steps; a few configurations
tried, the best kept), checks they agree, and prints the bandwidth each reaches. No engine code
changes: this only says whether swapping one in is worth it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv (Llama-3.2-1B)": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "qkv (Llama-3.1-8B)": (6144, 4096), "o (8B)": (4096, 4096)}


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y


def timed_us(fn, reps: int = 96) -> float:
    """Median over 5 batches of `reps` calls replayed from a CUDA graph (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def main() -> None:
    torch.manual_seed(0)
    configs = [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8)]
    print(f"{'projection':20s} {'N x K':>12s} {'cuBLAS us':>10s} {'GB/s':>6s} {'Triton us':>10s} {'GB/s':>6s}  best config")
    for name, (n, k) in SHAPES.items():
        # As many copies of the weight as 16 layers would hold, used in turn: each call reads its
        # weight from memory, as in the model, not from the 50 MB L2 cache the last call filled.
        copies = max(4, -(-400 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = ws[0]
        ref = F.linear(x, w)[0]
        turn = iter(range(10**9))
        cublas = timed_us(lambda: F.linear(x, ws[next(turn) % copies]))
        best = None
        for bn, bk, warps in configs:
            if bk > k:
                continue
            out = gemv(x[0], w, bn, bk, warps)
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
            t = timed_us(lambda: gemv(x[0], ws[next(turn) % copies], bn, bk, warps))
            if best is None or t < best[0]:
                best = (t, bn, bk, warps)
        del ws
        gb = w.numel() * 2 / 1e9
        print(f"{name:20s} {n:>5d} x {k:<5d} {cublas:10.2f} {gb / cublas * 1e6:6.0f} {best[0]:10.2f} "
              f"{gb / best[0] * 1e6:6.0f}  BLOCK_N={best[1]} BLOCK_K={best[2]} warps={best[3]}")


if __name__ == "__main__":
    main()
