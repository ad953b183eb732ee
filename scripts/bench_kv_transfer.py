"""Issue 35's link figure: how fast a KV connector moves one request's blocks, by prompt length.

Two block pools in one process (on a machine with two GPUs: cuda:0 the prefill side's, cuda:1 the
decode side's), a connector on each (each with its own thread, as in two instances), and for each
prompt length the blocks of that many tokens sent and pulled `--repeats` times:

- stage ms: the prefill side's `send` (the blocks copied out of its pool: on the GPU for nccl, to
  pinned host memory for gloo);
- transfer ms: the decode side's pull to the bytes in its blocks (`Landed.seconds`: the request
  waits this long on the decode instance), and the bytes over it, GB/s.

    python scripts/bench_kv_transfer.py --shape 1b --connector nccl gloo     # two GPUs
    python scripts/bench_kv_transfer.py --device cpu --tokens 64 256         # anywhere (gloo): a smoke test

Medians of the repeats, with the range. Shapes are the K/V of one token of every layer: 1b is
16 layers x 8 KV heads x 64 dims (32 KiB a token in bf16), 8b is 32 x 8 x 128 (128 KiB).
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import sys
import time

import torch

from nanoserve.attention.paged import PagedKVCache
from nanoserve.runner.kv_connector import make_connector
from nanoserve.testing import free_ports

SHAPES = {"1b": (16, 8, 64), "8b": (32, 8, 128), "tiny": (2, 2, 16)}


def wait_landed(connector, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        landed = connector.landed()
        if landed:
            return landed[0]
        connector.wait_for_landing(0.01)
    raise TimeoutError(f"no transfer landed within {timeout} s")


def measure(kind: str, devices: tuple[str, str], shape: tuple[int, int, int], tokens: list[int], block_size: int,
            repeats: int, dtype: torch.dtype) -> list[dict]:
    layers, heads, dim = shape
    blocks = -(-max(tokens) // block_size)
    src = PagedKVCache(layers, blocks, block_size, heads, dim, dtype=dtype, device=devices[0])
    dst = PagedKVCache(layers, blocks, block_size, heads, dim, dtype=dtype, device=devices[1])
    src.k.normal_()
    src.v.normal_()
    address = f"127.0.0.1:{free_ports(1)}"
    decode = make_connector(kind, dst, "decode", address, timeout=60.0)
    prefill = make_connector(kind, src, "prefill", address, timeout=60.0)
    rows = []
    try:
        for n in [tokens[0]] + tokens:  # the first size twice: its first run sets the link up (untimed)
            ids = list(range(-(-n // block_size)))
            stage, transfer, num_bytes = [], [], 0
            for i in range(repeats):
                start = time.perf_counter()
                prefill.send(f"{n}-{i}-{len(rows)}", ids)
                stage.append(time.perf_counter() - start)
                decode.receive(f"{n}-{i}-{len(rows)}", ids)
                landed = wait_landed(decode, 120.0)
                if landed.error is not None:
                    raise landed.error
                transfer.append(landed.seconds)
                num_bytes = landed.num_bytes
            rows.append(dict(connector=kind, tokens=n, mib=num_bytes / 2**20,
                             stage_ms=[1e3 * s for s in stage], transfer_ms=[1e3 * s for s in transfer],
                             gb_s=[num_bytes / 1e9 / s for s in transfer]))
        assert torch.equal(dst.k[:, : len(ids)].cpu(), src.k[:, : len(ids)].cpu())  # the last one, bit for bit
    finally:
        prefill.close()
        decode.close()
    return rows[1:]


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="default: %(default)s")
    ap.add_argument("--connector", nargs="+", choices=["nccl", "gloo"], default=["nccl", "gloo"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096],
                    help="prompt lengths (default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds before the run stops, printing where each thread was (default: %(default)s)")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True, file=sys.__stderr__)  # a connector that never joins ends the run
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("bench_kv_transfer moves blocks between two GPUs; this machine has fewer (use --device cpu)")
        return 2
    devices = ("cuda:0", "cuda:1") if args.device == "cuda" else ("cpu", "cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    kinds = [k for k in args.connector if args.device == "cuda" or k == "gloo"]
    where = f"{torch.cuda.get_device_name()} x2" if args.device == "cuda" else "CPU"
    print(f"KV transfer, {args.shape} shape {SHAPES[args.shape]} ({dtype}), {where}, median of {args.repeats} "
          "(lowest-highest)")
    print(f"{'connector':>9} {'tokens':>7} {'MiB':>8} {'stage ms':>22} {'transfer ms':>24} {'GB/s':>22}")
    for kind in kinds:
        for r in measure(kind, devices, SHAPES[args.shape], sorted(args.tokens), args.block_size, args.repeats, dtype):
            print(f"{kind:>9} {r['tokens']:>7} {r['mib']:>8.3f} {spread(r['stage_ms'], '.2f'):>22} "
                  f"{spread(r['transfer_ms'], '.2f'):>24} {spread(r['gb_s'], '.1f'):>22}")
            sys.stdout.flush()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
