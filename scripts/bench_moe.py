"""Issue 37's kernel figures: one Mixtral-8x7B-shaped MoE block (hidden 4096, 14336 features per
expert, 8 experts, top-2), timed three ways at each token count:

- the per-expert loop (`nanoserve.model.moe.experts_loop`, the reference: a gather, two products
  and a scatter per expert, its rows found on the host);
- the grouped kernels (`nanoserve.kernels.moe.fused_moe`: align, gate_up + SiLU·up, down with the
  routing weight, the combine), and alone the alignment they use on a GPU (`align_by_expert_triton`,
  two small kernels) beside the PyTorch one it replaced (`align_by_expert`, the CPU path);
- a dense SwiGLU of the same active FLOPs: T·k rows through one expert's weights (two matrix
  products and SiLU·up, no routing): the speed the grouped kernels would have if grouping cost nothing.

    python scripts/bench_moe.py                  # on a CUDA GPU: bfloat16, 64 and 1024 tokens
    python scripts/bench_moe.py --processes 5    # the same in 5 separate processes: medians, ranges
    python scripts/bench_moe.py --sweep --sweep-out sweep.json
                                                 # time tile configurations of the grouped kernels at
                                                 # 1 to 4096 tokens; print the best as a GPU_TILES table
    python scripts/bench_moe.py --processes 5 --tiles sweep.json
                                                 # with the sweep's tiles, before they are in the code
    python scripts/bench_moe.py --tiny           # anywhere: a tiny block through Triton's interpreter on
                                                 # the CPU, to check the script runs (its times mean nothing)

Times are medians of `--iters` runs after `--warmup` (CUDA synchronized around each run). The
fused output is checked against the loop's (max |difference| relative to the largest output). A run
stops after `--timeout` seconds, printing what it has, exit code 1 (with --processes: each child).

Issue 37's targets: fused ≥ 3× the loop at 64 tokens; fused within 1.5× the dense SwiGLU at 1024.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--tiny" in sys.argv:  # Triton's interpreter must be chosen before triton is first imported
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve.kernels.moe import (GPU_TILES, align_by_expert, align_by_expert_triton, fused_moe,  # noqa: E402
                                   moe_blocks_for)
from nanoserve.model.moe import experts_loop, route  # noqa: E402

TINY = dict(hidden=64, ffn=96, experts=8, top_k=2, iters=2, warmup=1)
FIGURES = ["loop_ms", "fused_ms", "align_ms", "align_torch_ms", "dense_ms"]

# The sweep's tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), around GPU_TILES's first
# choices (marked *). Small BLOCK_M for decode (a block's rows are mostly padding), and BLOCK_M of 32
# or 64 there too: an expert's rows in one block read its weights once. Deeper pipelines for the
# memory-bound sizes, wider tiles for the large ones.
SWEEP_TILES = [
    (16, 64, 64, 4, 3),  # *
    (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (16, 64, 64, 4, 5), (16, 128, 128, 4, 4), (16, 32, 128, 4, 4),
    (32, 64, 64, 4, 3),  # *
    (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
    (64, 128, 64, 8, 3),  # *
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 4), (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
]
TINY_TILES = [(16, 32, 32, 4, 1), (32, 32, 64, 4, 1)]


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


def block_inputs(tokens: int, w13: torch.Tensor, num_experts: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """x [T, H], routing weights and ids [T, k]: the same for a token count in every run."""
    device, dtype = w13.device, w13.dtype
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, w13.shape[2], generator=g, device=device).to(dtype)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g, device=device), top_k, renormalize=True)
    return x, weights, ids


def rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def measure(tokens: int, w13, w2, num_experts: int, top_k: int, iters: int, warmup: int) -> dict:
    cuda = w13.device.type == "cuda"
    x, weights, ids = block_inputs(tokens, w13, num_experts, top_k)
    bm = moe_blocks_for(tokens * top_k, num_experts, not cuda)["BLOCK_M"]
    groups = num_experts + 1  # as fused_moe aligns: one group more, for the pairs that run no expert
    error = rel_error(fused_moe(x, w13, w2, weights, ids), experts_loop(x, w13, w2, weights, ids))
    row = dict(tokens=tokens, block_m=bm, rel_error=error,
               loop_ms=timed(lambda: experts_loop(x, w13, w2, weights, ids), iters, warmup, cuda),
               fused_ms=timed(lambda: fused_moe(x, w13, w2, weights, ids), iters, warmup, cuda),
               align_ms=timed(lambda: align_by_expert_triton(ids, groups, bm), iters, warmup, cuda),
               align_torch_ms=timed(lambda: align_by_expert(ids, groups, bm), iters, warmup, cuda),
               dense_ms=timed(lambda: dense_swiglu(x, w13, w2, top_k), iters, warmup, cuda))
    row["loop_over_fused"] = row["loop_ms"] / row["fused_ms"]
    row["fused_over_dense"] = row["fused_ms"] / row["dense_ms"]
    return row


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'tokens':>7} {'BLOCK_M':>7} {'loop ms':>9} {'fused ms':>9} {'align ms':>9} {'torch al.':>9} "
          f"{'dense ms':>9} {'loop/fused':>10} {'fused/dense':>11} {'rel err':>8}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['block_m']:>7} {r['loop_ms']:>9.3f} {r['fused_ms']:>9.3f} {r['align_ms']:>9.3f} "
              f"{r['align_torch_ms']:>9.3f} {r['dense_ms']:>9.3f} {r['loop_over_fused']:>10.2f} "
              f"{r['fused_over_dense']:>11.2f} {r['rel_error']:>8.1e}")
    print("align ms: align_by_expert_triton (fused_moe's on a GPU); torch al.: align_by_expert (PyTorch, the CPU path)")
    sys.stdout.flush()


# ----------------------------------------------------------------------------------- the sweep


def sweep_tiles(rows_per_expert: float, tiny: bool) -> list[dict[str, int]]:
    """The tiles worth timing when experts get this many rows on average: BLOCK_M at most 4 times that
    (64 always allowed) and at least an eighth of it (64 always allowed)."""
    tiles = TINY_TILES if tiny else [t for t in SWEEP_TILES
                                     if min(64, rows_per_expert / 8) <= t[0] <= max(64, 4 * rows_per_expert)]
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s) for m, n, k, w, s in tiles]


def sweep_one(tokens: int, w13, w2, num_experts: int, top_k: int, args) -> list[dict]:
    """fused_moe at each candidate tile, timed; a tile that fails to launch or to match the loop is skipped."""
    cuda = w13.device.type == "cuda"
    x, weights, ids = block_inputs(tokens, w13, num_experts, top_k)
    expected = experts_loop(x, w13, w2, weights, ids)
    tolerance = 2e-2 if w13.dtype != torch.float32 else 1e-4
    rows = []
    for tiles in sweep_tiles(tokens * top_k / num_experts, args.tiny):
        row = dict(tokens=tokens, **tiles)
        try:
            row["rel_error"] = rel_error(fused_moe(x, w13, w2, weights, ids, blocks=tiles), expected)
            if row["rel_error"] > tolerance:
                row["skipped"] = f"relative error {row['rel_error']:.1e} over {tolerance}"
            else:
                row["fused_ms"] = timed(lambda: fused_moe(x, w13, w2, weights, ids, blocks=tiles),
                                        args.iters, args.warmup, cuda)
        except TimedOut:
            raise
        except Exception as e:  # too much shared memory for the GPU, most often: not a candidate
            if timed_out:  # (Triton's interpreter wraps what the alarm raises in its own error)
                raise
            row["skipped"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:80] if str(e).strip() else ''}"
        rows.append(row)
        print(f"  {tokens:>5} tokens {tile_name(row):<26} " +
              (f"{row['fused_ms']:8.3f} ms" if "fused_ms" in row else f"skipped ({row['skipped']})"), flush=True)
    return rows


def tile_name(t: dict) -> str:
    return f"{t['BLOCK_M']}x{t['BLOCK_N']}x{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']}"


def suggested_tiles(best: dict[int, dict], top_k: int, num_experts: int) -> list[tuple[float, dict[str, int]]]:
    """GPU_TILES from each token count's fastest tiles: a bound between two measured counts at their
    rows per expert's geometric mean; neighbours with the same tiles merged."""
    counts = sorted(best)
    entries: list[tuple[float, dict[str, int]]] = []
    for i, tokens in enumerate(counts):
        tiles = {k: best[tokens][k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
        bound = (math.sqrt(tokens * counts[i + 1]) * top_k / num_experts) if i + 1 < len(counts) else math.inf
        if entries and entries[-1][1] == tiles:
            entries[-1] = (bound, tiles)
        else:
            entries.append((bound, tiles))
    return entries


def tiles_text(entries: list[tuple[float, dict[str, int]]]) -> str:
    """The table as Python, to paste over GPU_TILES in nanoserve/kernels/moe.py."""
    lines = ["GPU_TILES: list[tuple[float, dict[str, int]]] = ["]
    for bound, t in entries:
        text = 'float("inf")' if bound == math.inf else f"{bound:g}"
        lines.append(f"    ({text}, dict(BLOCK_M={t['BLOCK_M']}, BLOCK_N={t['BLOCK_N']}, BLOCK_K={t['BLOCK_K']}, "
                     f"num_warps={t['num_warps']}, num_stages={t['num_stages']})),")
    return "\n".join(lines + ["]"])


def use_swept_tiles(path: str) -> None:
    """`--tiles PATH`: GPU_TILES, for this run only, from a sweep's JSON (before pasting it into the code)."""
    entries = json.loads(Path(path).read_text())["gpu_tiles_entries"]
    GPU_TILES[:] = [(math.inf if bound is None else bound, tiles) for bound, tiles in entries]


def run_sweep(args, w13, w2, title: str, results: dict) -> None:
    """Fills `results` (the JSON written after) as it goes, so that a timeout keeps what was done."""
    print(title, "\nsweep of the grouped kernels' tiles (fused_moe, alignment included):", flush=True)
    results.update(title=title, rows=[], best={})
    for tokens in args.tokens:
        rows = sweep_one(tokens, w13, w2, args.experts, args.top_k, args)
        results["rows"] += rows
        timed_rows = sorted((r for r in rows if "fused_ms" in r), key=lambda r: r["fused_ms"])
        if timed_rows:
            results["best"][tokens] = timed_rows[0]
            print(f"  {tokens:>5} tokens: best {tile_name(timed_rows[0])} {timed_rows[0]['fused_ms']:.3f} ms", flush=True)
    print_sweep(results, args)


def print_sweep(results: dict, args) -> None:
    """Each token count's fastest tiles, beside the time of the tiles `moe_blocks_for` picks now."""
    interpreted = not torch.cuda.is_available()
    print(f"\n{'tokens':>7} {'rows/expert':>11} {'best tiles':<26} {'ms':>8} {'now picked ms':>13}")
    for tokens, b in results["best"].items():
        picked = moe_blocks_for(tokens * args.top_k, args.experts, interpreted)
        now = [r["fused_ms"] for r in results["rows"] if r["tokens"] == tokens and "fused_ms" in r
               and all(r[k] == v for k, v in picked.items())]
        now_text = f"{now[0]:.3f}" if now else "-"
        print(f"{tokens:>7} {tokens * args.top_k / args.experts:>11g} {tile_name(b):<26} {b['fused_ms']:>8.3f} "
              f"{now_text:>13}")
    if results["best"]:
        entries = suggested_tiles({int(t): b for t, b in results["best"].items()}, args.top_k, args.experts)
        results["gpu_tiles"] = tiles_text(entries)  # to paste; and for --tiles (JSON has no infinity):
        results["gpu_tiles_entries"] = [(None if bound == math.inf else bound, t) for bound, t in entries]
        print("\nfor nanoserve/kernels/moe.py (GPU_TILES):\n" + results["gpu_tiles"])
    sys.stdout.flush()


# --------------------------------------------------------------------------- separate processes


def child_command(argv: list[str], json_out: str) -> list[str]:
    """This script's command line without --processes and --json-out, writing its rows to json_out."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--processes", "--json-out"):
            skip = True
        elif not a.startswith(("--processes=", "--json-out=")):
            kept.append(a)
    return [sys.executable, str(Path(__file__).resolve()), *kept, "--json-out", json_out]


def run_children(argv: list[str], args) -> list[list[dict]]:
    """`--processes` children one after another, each measuring every token count once; the rows of
    each that finished. They import the nanoserve this process imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(nanoserve.__file__).resolve().parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            out, start = os.path.join(tmp, f"child{i}.json"), time.perf_counter()
            try:
                done = subprocess.run(child_command(argv, out), env=env, capture_output=True, text=True,
                                      timeout=args.timeout + 120)  # its own alarm first; then starting, importing
                ok = done.returncode == 0 and os.path.exists(out)
                tail = "" if ok else (done.stdout + done.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                ok, tail = False, f"killed after {args.timeout + 120} s"
            print(f"process {i + 1}/{args.processes}: {'done' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s",
                  flush=True)
            if ok:
                runs.append(json.loads(Path(out).read_text())["rows"])
            else:
                print(tail, flush=True)
    return runs


def summarize(runs: list[list[dict]]) -> list[dict]:
    """Per token count (those every run measured): the median and range of each figure across runs."""
    counts = [t for t in (r["tokens"] for r in runs[0]) if all(any(r["tokens"] == t for r in run) for run in runs)]
    summary = []
    for tokens in counts:
        rows = [next(r for r in run if r["tokens"] == tokens) for run in runs]
        s = dict(tokens=tokens, block_m=rows[0]["block_m"], runs=len(rows), rel_error=max(r["rel_error"] for r in rows))
        for f in FIGURES:
            values = [r[f] for r in rows]
            s[f], s[f + "_min"], s[f + "_max"] = statistics.median(values), min(values), max(values)
        s["loop_over_fused"] = s["loop_ms"] / s["fused_ms"]
        s["fused_over_dense"] = s["fused_ms"] / s["dense_ms"]
        summary.append(s)
    return summary


def print_summary(summary: list[dict], title: str, processes: int) -> None:
    print(f"{title}\nmedians across {processes} separate processes (lowest-highest); ratios of the medians")
    heads = ["loop ms", "fused ms", "align ms", "torch align ms", "dense ms"]
    print(f"{'tokens':>7} {'BLOCK_M':>7} " + " ".join(f"{h:>21}" for h in heads) + f" {'loop/fused':>10} {'fused/dense':>11}")
    for s in summary:
        cells = [f"{s[f]:.3f} ({s[f + '_min']:.3f}-{s[f + '_max']:.3f})" for f in FIGURES]
        print(f"{s['tokens']:>7} {s['block_m']:>7} " + " ".join(f"{c:>21}" for c in cells) +
              f" {s['loop_over_fused']:>10.2f} {s['fused_over_dense']:>11.2f}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------- the run


class TimedOut(Exception):
    pass


timed_out: list[bool] = []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="token counts (default: 64 1024; with --sweep 1 16 64 256 1024 4096; 8 40 with --tiny)")
    ap.add_argument("--hidden", type=int, default=4096, help="default: %(default)s (Mixtral 8x7B)")
    ap.add_argument("--ffn", type=int, default=14336, help="features per expert (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=8, help="default: %(default)s")
    ap.add_argument("--top-k", type=int, default=2, help="default: %(default)s")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="default: %(default)s (float32 with --tiny)")
    ap.add_argument("--iters", type=int, default=20, help="timed runs per figure (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs first (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=600,
                    help="seconds before a run stops (with --processes: each child's; default: %(default)s)")
    ap.add_argument("--processes", type=int, default=0,
                    help="measure in N separate processes, one after another: medians and ranges across them "
                         "(not with --sweep)")
    ap.add_argument("--sweep", action="store_true", help="time the grouped kernels' tile configurations instead")
    ap.add_argument("--sweep-out", default=None, help="with --sweep: write every timing and the best tiles as JSON")
    ap.add_argument("--json-out", default=None, help="write the rows (with --processes: the medians) as JSON")
    ap.add_argument("--tiles", default=None,
                    help="a --sweep-out JSON: its best tiles as GPU_TILES for this run (default: the code's table)")
    ap.add_argument("--tiny", action="store_true", help="a tiny block (on the CPU: Triton's interpreter): a smoke test")
    args = ap.parse_args(argv)
    if args.tiny:
        args.hidden, args.ffn, args.experts, args.top_k = TINY["hidden"], TINY["ffn"], TINY["experts"], TINY["top_k"]
        args.iters, args.warmup, args.dtype = TINY["iters"], TINY["warmup"], "float32"
    args.tokens = args.tokens or ([8, 40] if args.tiny else [1, 16, 64, 256, 1024, 4096] if args.sweep else [64, 1024])
    return args


def measure_all(args, title: str, results: dict) -> None:
    device, dtype = ("cuda" if torch.cuda.is_available() else "cpu"), getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(args.experts, 2 * args.ffn, args.hidden, generator=g, device=device) * args.hidden**-0.5).to(dtype)
    w2 = (torch.randn(args.experts, args.hidden, args.ffn, generator=g, device=device) * args.ffn**-0.5).to(dtype)
    if args.sweep:
        run_sweep(args, w13, w2, title, results)
    else:
        results.update(title=title, rows=[])
        for tokens in args.tokens:
            results["rows"].append(measure(tokens, w13, w2, args.experts, args.top_k, args.iters, args.warmup))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench_moe times Triton kernels on a CUDA GPU; without one, run it with --tiny (a smoke test)")
        return 2
    if args.tiles:
        use_swept_tiles(args.tiles)
    title = (f"MoE block: hidden {args.hidden}, {args.experts} experts of {args.ffn} features, top-{args.top_k}, "
             f"{args.dtype}, {torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}"
             + (f", tiles from {args.tiles}" if args.tiles else ""))
    if args.processes > 0 and not args.sweep:
        runs = run_children(sys.argv[1:] if argv is None else argv, args)
        if not runs:
            return 1
        summary = summarize(runs)
        print_summary(summary, title, len(runs))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(dict(title=title, processes=len(runs), rows=summary), indent=1))
        return 0 if len(runs) == args.processes else 1

    def stop(signum, frame):
        timed_out.append(True)
        raise TimedOut()

    timed_out.clear()
    signal.signal(signal.SIGALRM, stop)
    signal.alarm(args.timeout)
    results: dict = {}
    code = 0
    try:
        measure_all(args, title, results)
    except Exception:  # (Triton's interpreter wraps what the alarm raises in its own error)
        if not timed_out:
            raise
        code = 1
    finally:
        signal.alarm(0)
    out = args.sweep_out if args.sweep else args.json_out
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    if args.sweep:
        if code:
            print_sweep(results, args)
    else:
        print_table(results.get("rows", []), title)
    if code:
        print(f"stopped after --timeout {args.timeout} s")
        return 1
    if not args.sweep:
        print("targets (issue 37): loop/fused >= 3 at 64 tokens; fused/dense <= 1.5 at 1024 tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
