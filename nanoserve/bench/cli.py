"""`nanoserve bench ...`: the subcommands and their options."""

from __future__ import annotations

import argparse

from nanoserve.bench import alternate, prefix, spec
from nanoserve.bench.common import int_pair
from nanoserve.bench.latency import bench_latency
from nanoserve.bench.serving import bench_serving
from nanoserve.bench.throughput import bench_throughput
from nanoserve.server.app import port_number

QUICK = dict(prompt_len=16, new_tokens=24, num_requests=8, lengths=(8, 32), rates="4", requests=6,
             output_len=(8, 16))




def add_arguments(p: argparse.ArgumentParser) -> None:
    from nanoserve.bench.capstone import TRACKS
    from nanoserve.engine.config import EngineConfig

    p.add_argument("what", choices=["latency", "throughput", "serving", "prefix", "spec", "all"],
                   help="all: latency, throughput and serving; prefix: week 14's prefix-caching workloads; "
                        "spec: week 17's speculative decoding at batch 1")
    # In the current directory, where the figures are easy to find and copy into docs/benchmarks.md
    # (not a hidden per-user folder); the repository's .gitignore keeps them out of `git status`.
    p.add_argument("--out", default="bench-results",
                   help="folder for the JSON files and plots, in the current directory unless a path (default: "
                        "%(default)s, which git ignores in this repository)")
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test that runs on a CPU")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HuggingFace side-by-side runs")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="latency: skip the torch.compile static-cache baseline")
    p.add_argument("--prompt-len", type=int, default=128, help="latency: prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=256, help="latency: tokens to generate (default: %(default)s)")
    p.add_argument("--runs", type=int, default=None, help="latency: timed runs (default 5; the first one compiles, "
                   "so at least 2)")
    p.add_argument("--num-requests", type=int, default=256, help="throughput: requests (default: %(default)s)")
    p.add_argument("--lengths", type=int_pair, default=(100, 1024), help="throughput and serving: prompt lengths "
                   "LOW,HIGH; throughput outputs too (default: 100,1024)")
    p.add_argument("--output-len", type=int_pair, default=(100, 512),
                   help="serving: output lengths LOW,HIGH (default: 100,512)")
    p.add_argument("--rates", default="2,6,12", help="serving: arrival rates, requests/s (default: %(default)s)")
    p.add_argument("--requests", type=int, default=60, help="serving: requests per rate (default: %(default)s)")
    p.add_argument("--port", type=port_number, default=8471, help="serving: the server's port (default: %(default)s)")
    p.add_argument("--server-args", default="", help="serving: more options for `nanoserve serve`, in one string "
                   "given with an = sign: --server-args=\"--no-cuda-graphs\" (default: none)")
    p.add_argument("--hf-time-limit", type=float, default=None,
                   help="throughput: stop HF after this many seconds (its speed is then reported as a bound)")
    p.add_argument("--profile", action="store_true", help="latency, throughput: where the time of a decode step goes")
    p.add_argument("--check", choices=sorted(TRACKS), default=None,
                   help="serving: run a capstone track's workload and check its targets (weeks/capstone/README.md)")
    p.add_argument("--compare-reference", action="store_true",
                   help="with --check: serve the reference engine on the same workload first, on this machine, and "
                        "judge the workspace by its ratios to it instead of the absolute targets (default: off)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="throughput: split the requests over this many replicas, each a process on GPUs of its "
                        "own; serving: serve them behind the data-parallel front (week 18; default: %(default)s)")
    prefix.add_arguments(p)
    spec.add_arguments(p)
    alternate.add_arguments(p)  # --repeats, --run-timeout of prefix and spec
    EngineConfig.add_arguments(p)  # the engine's own options: --model, --device, --max-num-seqs, ...


def run(args: argparse.Namespace) -> int:

    if args.quick:
        for key, value in (QUICK | prefix.QUICK | spec.QUICK).items():
            setattr(args, key, value)
    args.prompt_range = args.output_range = tuple(args.lengths)
    args.serving_output_range = tuple(args.output_len)
    todo = ["latency", "throughput", "serving"] if args.what == "all" else [args.what]
    if args.runs is not None and (args.check or "latency" not in todo):
        raise ValueError(f"--runs sets the timed runs of latency, not of {'--check' if args.check else args.what}")
    if args.repeats is not None and (args.check or set(todo) - {"prefix", "spec"}):
        raise ValueError(f"--repeats sets the processes per setting of prefix and spec, not of "
                         f"{'--check' if args.check else args.what}")
    if args.compare_reference and not args.check:
        raise ValueError("--compare-reference judges a capstone track's run: add --check capstone-cpu (or -gpu)")
    if args.check:
        from nanoserve.bench.capstone import TRACKS, run_check

        return run_check(args, TRACKS[args.check])
    args.runs = 5 if args.runs is None else args.runs
    if args.runs < 2:
        raise ValueError(f"--runs {args.runs}: at least 2 (the first run compiles kernels and is not counted)")
    if args.data_parallel_size > 1 and set(todo) - {"throughput", "serving"}:
        raise ValueError(f"--data-parallel-size applies to throughput and serving, not to {args.what}: one replica "
                         "is what latency, prefix and spec measure")
    for what in todo:
        {"latency": bench_latency, "throughput": bench_throughput, "serving": bench_serving,
         "prefix": prefix.bench_prefix, "spec": spec.bench_spec}[what](args)
    return 0

