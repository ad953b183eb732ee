"""Week 19: the paged-attention kernel with a sliding window against full attention, decode steps
at long contexts (Llama-3.2-1B heads, block size 16, bf16, shuffled block tables).

    python scripts/bench_sliding_window.py --out docs/bench        # on a CUDA GPU

A window of W keys needs only the last W of each sequence's K/V: the kernel starts its loop at the
window (and splits only the visible range across programs), so its time should follow
min(context, W), not the context. For each batch x context x window it prints the GPU time (CUDA
graph replays, L2 flushed: `graph_time_ms` of bench_paged_attention.py) and the bandwidth over the
bytes that must be read (K/V inside the window, Q, O), as a % of the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from bench_paged_attention import HEAD_DIM, HEADS, KV_HEADS, graph_time_ms, make_inputs

from nanoserve.bench.common import copy_bandwidth
from nanoserve.kernels.paged_attention import paged_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--windows", default="0,512,4096", help="0: full attention")
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args()
    peak = copy_bandwidth("cuda")
    rows = []
    print(f"{'batch':>5} {'context':>7} {'window':>6} {'us':>9} {'GB/s':>7} {'% copy':>6} {'vs full':>7}")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            q, k_cache, v_cache, tables, lens = make_inputs(batch, context, torch.bfloat16)
            starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            full_us = None
            for window in map(int, args.windows.split(",")):
                w = window or None

                def run():
                    return paged_attention(q, k_cache, v_cache, tables, starts, lens, 1, context, window=w)

                us = graph_time_ms(run) * 1000
                seen = min(context, window) if window else context
                nbytes = 2 * batch * seen * KV_HEADS * HEAD_DIM * 2 + 2 * batch * HEADS * HEAD_DIM * 2
                gbs = nbytes / (us * 1e-6) / 1e9
                full_us = full_us or us
                rows.append(dict(batch=batch, context=context, window=window, us=us, gb_s=gbs, pct_copy=100 * gbs * 1e9 / peak,
                                 speedup_vs_full=full_us / us))
                print(f"{batch:>5} {context:>7} {window or 'full':>6} {us:>9.1f} {gbs:>7.0f} {100 * gbs * 1e9 / peak:>5.0f}% "
                      f"{full_us / us:>6.2f}x")
            del q, k_cache, v_cache
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sliding_window.json"
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_gb_s=peak / 1e9, host=platform.node(),
                                    date=time.strftime("%Y-%m-%d"), rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
