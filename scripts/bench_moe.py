"""Issue 37's kernel figures: one Mixtral-8x7B-shaped MoE block (hidden 4096, 14336 features per
expert, 8 experts, top-2), timed three ways at each token count:

- the per-expert loop (`nanoserve.model.moe.experts_loop`, the reference: a gather, two products
  and a scatter per expert, its rows found on the host);
- the grouped kernels (`nanoserve.kernels.moe.fused_moe`: align, gate_up + SiLU·up, down with the
  routing weight, the combine);
- a dense SwiGLU of the same active FLOPs: T·k rows through one expert's weights (two matrix
  products and SiLU·up, no routing): the speed the grouped kernels would have if grouping cost nothing.

    python scripts/bench_moe.py                  # on a CUDA GPU: bfloat16, 64 and 1024 tokens
    python scripts/bench_moe.py --tiny           # anywhere: a tiny block through Triton's interpreter on
                                                 # the CPU, to check the script runs (its times mean nothing)

Times are medians of `--iters` runs after `--warmup` (CUDA synchronized around each run). The
fused output is checked against the loop's (max |difference| relative to the largest output). The
whole run stops after `--timeout` seconds, printing what it has, exit code 1.

Issue 37's targets: fused ≥ 3× the loop at 64 tokens; fused within 1.5× the dense SwiGLU at 1024.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

if "--tiny" in sys.argv:  # Triton's interpreter must be chosen before triton is first imported
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanoserve.kernels.moe import align_by_expert, fused_moe, moe_blocks_for  # noqa: E402
from nanoserve.model.moe import experts_loop, route  # noqa: E402

TINY = dict(hidden=64, ffn=96, experts=8, top_k=2, iters=2, warmup=1)


def dense_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> torch.Tensor:
    """T·k rows through expert 0's SwiGLU: the active FLOPs of the block, with no routing at all."""
    rows = x.repeat_interleave(top_k, dim=0)  # [T * k, H]
    gate, up = F.linear(rows, w13[0]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[0])


def timed(fn, iters: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of `fn()`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(tokens: int, w13, w2, num_experts: int, top_k: int, iters: int, warmup: int) -> dict:
    device, dtype = w13.device, w13.dtype
    cuda = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, w13.shape[2], generator=g, device=device).to(dtype)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g, device=device), top_k, renormalize=True)
    blocks = moe_blocks_for(tokens * top_k, num_experts, not cuda)
    loop = experts_loop(x, w13, w2, weights, ids)
    fused = fused_moe(x, w13, w2, weights, ids)
    error = ((fused.float() - loop.float()).abs().max() / loop.float().abs().max()).item()
    row = dict(tokens=tokens, block_m=blocks["BLOCK_M"], rel_error=error,
               loop_ms=timed(lambda: experts_loop(x, w13, w2, weights, ids), iters, warmup, cuda),
               fused_ms=timed(lambda: fused_moe(x, w13, w2, weights, ids), iters, warmup, cuda),
               align_ms=timed(lambda: align_by_expert(ids, num_experts, blocks["BLOCK_M"]), iters, warmup, cuda),
               dense_ms=timed(lambda: dense_swiglu(x, w13, w2, top_k), iters, warmup, cuda))
    row["loop_over_fused"] = row["loop_ms"] / row["fused_ms"]
    row["fused_over_dense"] = row["fused_ms"] / row["dense_ms"]
    return row


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'tokens':>7} {'BLOCK_M':>7} {'loop ms':>9} {'fused ms':>9} {'align ms':>9} {'dense ms':>9} "
          f"{'loop/fused':>10} {'fused/dense':>11} {'rel err':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['block_m']:>7} {r['loop_ms']:>9.3f} {r['fused_ms']:>9.3f} {r['align_ms']:>9.3f} "
              f"{r['dense_ms']:>9.3f} {r['loop_over_fused']:>10.2f} {r['fused_over_dense']:>11.2f} {r['rel_error']:>8.1e}")
    sys.stdout.flush()


class TimedOut(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts (default: 64 1024; 8 40 with --tiny)")
    ap.add_argument("--hidden", type=int, default=4096, help="default: %(default)s (Mixtral 8x7B)")
    ap.add_argument("--ffn", type=int, default=14336, help="features per expert (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=8, help="default: %(default)s")
    ap.add_argument("--top-k", type=int, default=2, help="default: %(default)s")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="default: %(default)s (float32 with --tiny)")
    ap.add_argument("--iters", type=int, default=20, help="timed runs per figure (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs first (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds before the run stops (default: %(default)s)")
    ap.add_argument("--tiny", action="store_true", help="a tiny block (on the CPU: Triton's interpreter): a smoke test")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench_moe times Triton kernels on a CUDA GPU; without one, run it with --tiny (a smoke test)")
        return 2
    if args.tiny:
        args.hidden, args.ffn, args.experts, args.top_k = TINY["hidden"], TINY["ffn"], TINY["experts"], TINY["top_k"]
        args.iters, args.warmup, args.dtype = TINY["iters"], TINY["warmup"], "float32"
    args.tokens = args.tokens or ([8, 40] if args.tiny else [64, 1024])

    def stop(signum, frame):
        timed_out.append(True)
        raise TimedOut()

    timed_out: list[bool] = []

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(args.timeout)
    rows: list[dict] = []
    title = (f"MoE block: hidden {args.hidden}, {args.experts} experts of {args.ffn} features, top-{args.top_k}, "
             f"{args.dtype}, {torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}")
    try:
        device, dtype = ("cuda" if cuda else "cpu"), getattr(torch, args.dtype)
        g = torch.Generator(device=device).manual_seed(0)
        scale = args.hidden ** -0.5
        w13 = (torch.randn(args.experts, 2 * args.ffn, args.hidden, generator=g, device=device) * scale).to(dtype)
        w2 = (torch.randn(args.experts, args.hidden, args.ffn, generator=g, device=device) * args.ffn ** -0.5).to(dtype)
        for tokens in args.tokens:
            rows.append(measure(tokens, w13, w2, args.experts, args.top_k, args.iters, args.warmup))
    except Exception:  # (Triton's interpreter wraps what the alarm raises in its own error)
        if not timed_out:
            raise
        print_table(rows, title)
        print(f"stopped after --timeout {args.timeout} s with {len(rows)} of {len(args.tokens)} token counts done")
        return 1
    finally:
        signal.alarm(0)
    print_table(rows, title)
    print("targets (issue 37): loop/fused >= 3 at 64 tokens; fused/dense <= 1.5 at 1024 tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
