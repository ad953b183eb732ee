"""The capstone: serve a real model with your own engine, to stated targets.

    nanoserve bench serving --model smollm2 --check capstone-cpu

runs `nanoserve bench serving` on the workload of the track (fixed here, whatever the other
options say), then prints every target with the measured value and PASS or MISS, and exits
with 1 if any target is missed. When NANOSERVE_WORKSPACE names a workspace, the server that
the benchmark starts runs that workspace's package (see `bench_serving`); the client that
measures it is always the reference. The lesson is `weeks/capstone/README.md`.

    NANOSERVE_WORKSPACE=workspace nanoserve bench serving --model smollm2 --check capstone-cpu --compare-reference

serves the reference engine on the same workload first, on this machine, then the workspace's,
and judges the workspace by its ratios to the reference (`RATIOS`) instead of the absolute
targets: a slow or busy machine slows both engines alike, and the ratios cancel it out.

The targets live here and nowhere else; the lesson prints them with `targets_table` and
`ratios_table`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# The serving row's keys that a target may name, with the words the report uses for them.
METRICS = {
    "ttft_p50_ms": ("TTFT p50", "ms"),
    "ttft_p99_ms": ("TTFT p99", "ms"),
    "itl_p50_ms": ("ITL p50", "ms"),
    "itl_p99_ms": ("ITL p99", "ms"),
    "output_tok_s": ("output throughput", "tok/s"),
}


@dataclass(frozen=True)
class Target:
    metric: str  # a key of METRICS
    limit: float
    at_least: bool = False  # throughput: measured >= limit; latencies: measured <= limit

    def met(self, measured: float) -> bool:
        return measured >= self.limit if self.at_least else measured <= self.limit

    def describe(self) -> str:
        name, unit = METRICS[self.metric]
        return f"{name} {'≥' if self.at_least else '≤'} {self.limit:g} {unit}"


@dataclass(frozen=True)
class Track:
    """One workload on one kind of machine, and the targets a served engine must meet on it."""

    name: str
    model: str  # what --model must say
    device: str
    dtype: str
    rate: float  # requests/s, Poisson arrivals
    requests: int
    prompt_len: tuple[int, int]  # uniform, in tokens
    output_len: tuple[int, int]  # uniform, in tokens; EOS ignored
    targets: tuple[Target, ...]  # empty: not measured yet
    measured_on: str  # the machine and engine the targets come from

    def workload(self) -> str:
        return (f"{self.requests} streaming requests at {self.rate:g} req/s (Poisson), prompts "
                f"U{list(self.prompt_len)}, outputs U{list(self.output_len)} tokens, {self.model} in "
                f"{self.dtype} on {self.device}")


PENDING_GPU = "GPU targets: measured in docs/benchmarks.md (pending)"


def serving_targets(**limits: float) -> tuple[Target, ...]:
    """One target per metric of METRICS, in its order: at most the limit for the latencies, at
    least the limit for the throughput."""
    return tuple(Target(metric, limits[metric], at_least=metric == "output_tok_s") for metric in METRICS)

TRACKS = {
    "capstone-cpu": Track(
        name="capstone-cpu", model="smollm2", device="cpu", dtype="float32",
        rate=0.5, requests=40, prompt_len=(32, 128), output_len=(32, 64),
        targets=serving_targets(ttft_p50_ms=600, ttft_p99_ms=2000, itl_p50_ms=160, itl_p99_ms=900, output_tok_s=28),
        # the reference's runs and the margins are in weeks/capstone/README.md, section 3
        measured_on="the reference engine on a 2-vCPU AMD EPYC VM, torch 2.13.0 (CPU)",
    ),
    "capstone-gpu": Track(
        name="capstone-gpu", model="smollm2", device="cuda", dtype="bfloat16",
        # the default workload of `bench serving`, at its middle rate
        rate=6.0, requests=60, prompt_len=(100, 1024), output_len=(100, 512),
        targets=serving_targets(ttft_p50_ms=60, ttft_p99_ms=200, itl_p50_ms=3, itl_p99_ms=15, output_tok_s=1450),
        # three runs of the reference on an H100 (SmolLM2's shape, random weights): weeks/capstone/README.md
        measured_on="the reference engine on an NVIDIA H100 80GB HBM3, torch 2.11.0+cu130",
    ),
}


# The ratios --compare-reference allows (yours / the reference's, measured one after the other on
# one machine): the margins the CPU track's targets leave over the reference's median
# (weeks/capstone/README.md, section 3), rounded: 2× for TTFT p50, 3× for the p99s (the least
# steady), 1.5× for ITL p50 (the steadiest), 0.85× for the throughput (which the arrivals set).
RATIOS = (Target("ttft_p50_ms", 2.0), Target("ttft_p99_ms", 3.0), Target("itl_p50_ms", 1.5),
          Target("itl_p99_ms", 3.0), Target("output_tok_s", 0.85, at_least=True))


def ratios_table(ratios: tuple[Target, ...] = RATIOS) -> str:
    """The ratios as the Markdown table the lesson shows (a test keeps the two equal)."""
    lines = ["| metric | yours / the reference's |", "|---|---|"]
    lines += [f"| {METRICS[r.metric][0]} | {'≥' if r.at_least else '≤'} {r.limit:g}× |" for r in ratios]
    return "\n".join(lines)


def targets_table(track: Track) -> str:
    """The targets as the Markdown table the lesson shows (a test keeps the two equal)."""
    if not track.targets:
        return PENDING_GPU
    lines = ["| metric | target |", "|---|---|"]
    for t in track.targets:
        name, unit = METRICS[t.metric]
        lines.append(f"| {name} | {'≥' if t.at_least else '≤'} {t.limit:g} {unit} |")
    return "\n".join(lines)


def apply_track(args: argparse.Namespace, track: Track) -> None:
    """Set the benchmark's workload and engine dtype/device to the track's (ValueError if the model differs)."""
    if str(args.model) != track.model:
        raise ValueError(f"the targets of {track.name} are for --model {track.model}, not {args.model!r}")
    if args.what != "serving":
        raise ValueError(f"--check runs the serving benchmark: `nanoserve bench serving --model {track.model} "
                         f"--check {track.name}`")
    args.rates, args.requests = f"{track.rate:g}", track.requests
    args.prompt_range, args.serving_output_range = track.prompt_len, track.output_len
    args.device, args.dtype = track.device, track.dtype


def report(track: Track, row: dict) -> int:
    """Print each target with its measured value and a verdict. Returns the exit status:
    0 every target met, 1 a target missed, 2 the track has no targets yet."""
    print(f"\n{track.name}: {track.workload()}")
    if not track.targets:
        for key, (name, unit) in METRICS.items():
            print(f"  {name:<18} {row[key]:>10.1f} {unit:<5}  (no target)")
        print(f"{PENDING_GPU}: nothing was checked")
        return 2
    missed = []
    for t in track.targets:
        measured = row[t.metric]
        ok = t.met(measured)
        missed += [] if ok else [t]
        name, unit = METRICS[t.metric]
        print(f"  {'PASS' if ok else 'MISS'}  {name:<18} {measured:>10.1f} {unit:<5}  target {t.describe()}")
    if missed:
        print(f"{track.name}: {len(missed)} of {len(track.targets)} targets missed "
              f"({', '.join(METRICS[t.metric][0] for t in missed)}); weeks/capstone/README.md says what each one points to")
        return 1
    print(f"{track.name}: all {len(track.targets)} targets met (targets from: {track.measured_on})")
    return 0


def report_ratios(track: Track, mine: dict, reference: dict, ratios: tuple[Target, ...] | None = None) -> int:
    """Print each metric for both engines, their ratio and a verdict on it (`ratios`: RATIOS by
    default). Returns the exit status: 0 every ratio within its limit, 1 one is not."""
    ratios = RATIOS if ratios is None else ratios
    print(f"\n{track.name}, your engine against the reference on this machine: {track.workload()}")
    print(f"        {'metric':<18} {'yours':>10} {'reference':>10} {'ratio':>7}  limit")
    missed = []
    for r in ratios:
        ratio = mine[r.metric] / reference[r.metric] if reference[r.metric] else float("inf")
        ok = r.met(ratio)
        missed += [] if ok else [r]
        name, unit = METRICS[r.metric]
        print(f"  {'PASS' if ok else 'MISS'}  {name:<18} {mine[r.metric]:>10.1f} {reference[r.metric]:>10.1f} "
              f"{ratio:>6.2f}×  {'≥' if r.at_least else '≤'} {r.limit:g}×  ({unit})")
    if missed:
        print(f"{track.name}: {len(missed)} of {len(ratios)} ratios missed "
              f"({', '.join(METRICS[r.metric][0] for r in missed)}); weeks/capstone/README.md, section 7, "
              "says what each one points to")
        return 1
    print(f"{track.name}: all {len(ratios)} ratios met: your engine keeps up with the reference on this machine")
    return 0


def run_check(args: argparse.Namespace, track: Track) -> int:
    """`nanoserve bench serving --check NAME`: the benchmark on the track's workload, then the
    verdicts; with `--compare-reference`, the reference's run first and the verdicts on ratios."""
    from nanoserve.bench.serving import bench_serving
    from nanoserve.course.stubs import ENV_VAR, workspace_from_env

    apply_track(args, track)
    if not getattr(args, "compare_reference", False):
        return report(track, bench_serving(args)["rows"][0])
    if workspace_from_env() is None:
        raise ValueError(f"--compare-reference compares a workspace with the reference: set {ENV_VAR}")
    out = args.out
    args.out = str(Path(out) / "reference")  # the two runs' JSON files side by side
    reference = bench_serving(args, reference=True)["rows"][0]
    args.out = out
    return report_ratios(track, bench_serving(args)["rows"][0], reference)
