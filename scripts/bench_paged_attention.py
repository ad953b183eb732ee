"""Benchmark the week-6 decode kernel: time and achieved memory bandwidth, next to torch SDPA.

    python scripts/bench_paged_attention.py --out docs/bench        # on a CUDA GPU

For each batch size x context length (Llama-3.2-1B heads: 32 query heads, 8 KV heads,
head_dim 64; block size 16; bf16) it times:
  - nanoserve's Triton kernel reading K/V through shuffled block tables (flash-decoding splits
    chosen by its heuristic, and also forced off, to show what splitting buys);
  - torch SDPA on *contiguous* K/V (enable_gqa), the same attention without paging;
  - FlexAttention on contiguous K/V, when the installed torch has it.
Bandwidth = bytes of K, V, Q and O that must cross memory / time, also as a % of the measured
device-to-device copy bandwidth (read + write). Kernel times are GPU times from CUDA-graph
replays with the L2 cache flushed before every call (`graph_time_ms`); the "eager" column adds
the Python launch overhead, as `triton.testing.do_bench` sees it. Writes a JSON file and a plot.

With `--fp8-kv` (issue 33) it also times the same kernel over an FP8 pool (the bf16 K/V quantized
to e4m3 codes with a float16 scale per token and head, `--kv-cache-dtype fp8`), whose bytes are
head_dim + 2 per token, head and K or V instead of 2 · head_dim: the "fp8 us" column, its GB/s
counted in the bytes it reads, and its time against bf16's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import random
import time
from pathlib import Path

import torch

from nanoserve.bench.common import copy_bandwidth

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16


def graph_time_ms(fn, reps: int = 20, trials: int = 5) -> float:
    """GPU time of one call of `fn`, without CPU launch overhead and with a cold L2 cache.

    Replays a CUDA graph of [flush L2, fn] x reps, subtracts a graph of [flush L2] x reps, and
    keeps the best of a few trials. Launch overhead (which CUDA graphs remove in the engine,
    week 12) would otherwise dominate small shapes and hide what the kernel itself costs.
    """
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > the 50 MB L2
    fn()  # compile / warm up outside the graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        return g

    def replay_ms(g: torch.cuda.CUDAGraph) -> float:
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    both, flush_only = capture(True), capture(False)
    best = min(replay_ms(both) - replay_ms(flush_only) for _ in range(trials))
    return max(best, 1e-4) / reps


def make_inputs(batch: int, context: int, dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    order = list(range(num_blocks))
    rng.shuffle(order)  # a realistic, scattered pool
    tables = torch.tensor(order, dtype=torch.int32, device="cuda").view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    return q, k_cache, v_cache, tables, lens


def contiguous_kv(k_cache, tables, batch, context):
    """[batch, KV_HEADS, context, HEAD_DIM] copies of each sequence's keys (for SDPA/Flex)."""
    k = k_cache[tables.long()].flatten(1, 2)[:, :context]  # [B, ctx, Hkv, D]
    return k.transpose(1, 2).contiguous()


def kv_bytes(batch: int, context: int, itemsize: int) -> int:
    kv = 2 * batch * context * KV_HEADS * HEAD_DIM * itemsize
    qo = 2 * batch * HEADS * HEAD_DIM * itemsize
    return kv + qo


def fp8_pool(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """Issue 33: the pool as e4m3 codes and float16 scales [num_blocks, block_size, KV_HEADS]."""
    from nanoserve.attention.fp8_cache import quantize_kv

    (k8, ks), (v8, vs) = quantize_kv(k_cache), quantize_kv(v_cache)
    return k8, v8, ks[..., 0].contiguous(), vs[..., 0].contiguous()


def fp8_bytes(batch: int, context: int) -> int:
    """What a decode step over an FP8 pool must read and write: codes and scales, bf16 q and out."""
    return 2 * batch * context * KV_HEADS * (HEAD_DIM + 2) + 2 * batch * HEADS * HEAD_DIM * 2


def main() -> None:
    from triton.testing import do_bench

    from nanoserve.kernels.paged_attention import choose_num_splits

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="try kernel tile/warp/stage settings at batch 64 x 2048")
    ap.add_argument("--fp8-kv", action="store_true", help="also time the kernel over an FP8 pool (issue 33)")
    args = ap.parse_args()
    dtype = torch.bfloat16
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    peak = copy_bandwidth("cuda") / 1e9
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: measured device-to-device copy bandwidth {peak:.0f} GB/s (read + write)")

    if args.sweep:
        sweep(peak)
        split_sweep(peak)

    flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            torch._dynamo.config.cache_size_limit = 64  # one compiled kernel per shape
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # older torch
            print(f"FlexAttention unavailable: {e}")

    rows = []
    header = (f"{'batch':>5} {'ctx':>5} | {'triton us':>9} {'GB/s':>6} {'%copy':>6} {'splits':>6} | "
              f"{'no-split us':>11} {'eager us':>8} | {'sdpa us':>8} {'%copy':>6} | {'flex us':>8} {'%copy':>6}"
              + (f" | {'fp8 us':>8} {'%copy':>6} {'x bf16':>6}" if args.fp8_kv else ""))
    print(header)
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            q, k_cache, v_cache, tables, lens = make_inputs(batch, context, dtype)
            nbytes = kv_bytes(batch, context, q.element_size())
            splits = choose_num_splits(batch, KV_HEADS, context, q.device)

            def run(num_splits=None):
                return decode(q, k_cache, v_cache, tables, lens, context, num_splits=num_splits)

            ms = graph_time_ms(run)
            ms_nosplit = graph_time_ms(lambda: run(1))
            ms_eager = do_bench(run, warmup=25, rep=200)  # with Python launch overhead
            k = contiguous_kv(k_cache, tables, batch, context)
            v = contiguous_kv(v_cache, tables, batch, context)
            q4 = q[:, :, None, :]  # [B, H, 1, D]
            # Check the kernel against SDPA before timing either.
            ref = torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0]
            torch.testing.assert_close(run(), ref, atol=2e-2, rtol=2e-2)
            ms_sdpa = graph_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
            ms_flex = None
            if flex is not None:
                try:
                    ms_flex = graph_time_ms(lambda: flex(q4, k, v, enable_gqa=True))
                except Exception as e:
                    print(f"  flex failed at batch {batch} ctx {context}: {type(e).__name__}: {str(e)[:120]}")
                    flex = None
            gbs = lambda t: nbytes / (t * 1e-3) / 1e9  # noqa: E731
            row = dict(batch=batch, context=context, bytes=nbytes, splits=splits,
                       triton_us=ms * 1e3, triton_gbs=gbs(ms), triton_pct=100 * gbs(ms) / peak,
                       nosplit_us=ms_nosplit * 1e3, nosplit_pct=100 * gbs(ms_nosplit) / peak,
                       eager_us=ms_eager * 1e3,
                       sdpa_us=ms_sdpa * 1e3, sdpa_pct=100 * gbs(ms_sdpa) / peak,
                       flex_us=None if ms_flex is None else ms_flex * 1e3,
                       flex_pct=None if ms_flex is None else 100 * gbs(ms_flex) / peak)
            fp8_txt = ""
            if args.fp8_kv:  # issue 33: the same step over e4m3 codes and their scales
                k8, v8, ks, vs = fp8_pool(k_cache, v_cache)
                run_fp8 = functools.partial(decode, q, k8, v8, tables, lens, context, k_scale=ks, v_scale=vs)
                widened = [(c.float() * s.float()[..., None]).to(dtype) for c, s in ((k8, ks), (v8, vs))]
                ref8 = torch.nn.functional.scaled_dot_product_attention(
                    q4, *(contiguous_kv(w, tables, batch, context) for w in widened), enable_gqa=True)[:, :, 0]
                torch.testing.assert_close(run_fp8(), ref8, atol=2e-2, rtol=2e-2)
                ms8 = graph_time_ms(run_fp8)
                gbs8 = fp8_bytes(batch, context) / (ms8 * 1e-3) / 1e9
                row.update(fp8_us=ms8 * 1e3, fp8_gbs=gbs8, fp8_pct=100 * gbs8 / peak, fp8_speedup=ms / ms8)
                fp8_txt = f" | {ms8 * 1e3:>8.1f} {row['fp8_pct']:>5.1f}% {ms / ms8:>5.2f}x"
                del k8, v8, ks, vs, widened
            rows.append(row)
            flex_txt = f"{row['flex_us']:>8.1f} {row['flex_pct']:>5.1f}%" if ms_flex else f"{'-':>8} {'-':>6}"
            print(f"{batch:>5} {context:>5} | {row['triton_us']:>9.1f} {row['triton_gbs']:>6.0f} "
                  f"{row['triton_pct']:>5.1f}% {splits:>6} | {row['nosplit_us']:>11.1f} {row['eager_us']:>8.1f} | "
                  f"{row['sdpa_us']:>8.1f} {row['sdpa_pct']:>5.1f}% | {flex_txt}{fp8_txt}", flush=True)
            del q, k_cache, v_cache, k, v
            torch.cuda.empty_cache()

    result = dict(gpu=gpu, torch=torch.__version__, triton=__import__("triton").__version__,
                  python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
                  copy_gbs=peak, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  block_size=BLOCK_SIZE, dtype="bfloat16", fp8_kv=args.fp8_kv, rows=rows)
    name = "paged_attention_fp8" if args.fp8_kv else "paged_attention"
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / f"{name}.png")
    print(f"wrote {out_dir / f'{name}.json'} and {out_dir / f'{name}.png'}")


def decode(q, k_cache, v_cache, tables, lens, context, **launch):
    """A decode step (one new token per sequence) through week 6's paged-attention kernel."""
    from nanoserve.kernels.paged_attention import paged_attention

    starts = torch.arange(len(lens) + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, k_cache, v_cache, tables, starts, lens, 1, context, **launch)


def sweep(peak: float, batch: int = 64, context: int = 2048) -> None:
    """Measure before deciding: the kernel's launch settings at one shape."""
    q, k_cache, v_cache, tables, lens = make_inputs(batch, context, torch.bfloat16)
    nbytes = kv_bytes(batch, context, q.element_size())
    print(f"sweep at batch {batch} x context {context}:")
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3):
                for splits in (1,):
                    try:
                        ms = graph_time_ms(lambda: decode(
                            q, k_cache, v_cache, tables, lens, context, num_splits=splits,
                            block_n=block_n, num_warps=warps, num_stages=stages))
                    except Exception as e:
                        print(f"  block_n {block_n} warps {warps} stages {stages} splits {splits}: {type(e).__name__}")
                        continue
                    pct = 100 * nbytes / (ms * 1e-3) / 1e9 / peak
                    print(f"  block_n {block_n:>3} warps {warps} stages {stages} splits {splits}: "
                          f"{ms * 1e3:7.1f} us {pct:5.1f}%", flush=True)


def split_sweep(peak: float) -> None:
    """How many context splits pay off, for the small batches where the grid is small."""
    print("context splits (flash-decoding):")
    for batch in (1, 4, 16, 32):
        for context in (512, 2048, 8192):
            q, k_cache, v_cache, tables, lens = make_inputs(batch, context, torch.bfloat16)
            nbytes = kv_bytes(batch, context, q.element_size())
            cells = []
            for splits in (1, 2, 4, 8, 16, 32, 64):
                if context / splits < 64:
                    continue
                ms = graph_time_ms(lambda: decode(q, k_cache, v_cache, tables, lens, context,
                                                                  num_splits=splits))
                cells.append(f"{splits}:{ms * 1e3:.1f}us/{100 * nbytes / (ms * 1e-3) / 1e9 / peak:.0f}%")
            print(f"  batch {batch:>3} ctx {context:>5}  " + "  ".join(cells), flush=True)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4 * len(contexts), 3.5), sharey=True)
    for ax, ctx in zip(axes, contexts):
        rows = [r for r in result["rows"] if r["context"] == ctx]
        xs = [r["batch"] for r in rows]
        ax.plot(xs, [r["triton_pct"] for r in rows], "o-", label="nanoserve Triton (paged)")
        ax.plot(xs, [r["sdpa_pct"] for r in rows], "s--", label="torch SDPA (contiguous)")
        if any(r["flex_pct"] for r in rows):
            ax.plot(xs, [r["flex_pct"] or float("nan") for r in rows], "^:", label="FlexAttention (contiguous)")
        ax.axhline(70, color="gray", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {ctx}")
        ax.set_xlabel("batch")
    axes[0].set_ylabel("% of measured copy bandwidth")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Decode attention, {result['gpu']}, bf16, 32/8 heads, head_dim 64", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
