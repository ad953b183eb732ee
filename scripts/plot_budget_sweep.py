"""Plot week 15's H100 budget sweep (docs/benchmarks.md): TTFT p50 and ITL p99 at 24 req/s against
the chunked-prefill budget, every run as a dot and the median as a line, chunking off as a band.

    python scripts/plot_budget_sweep.py   # reads docs/bench/week15_chunked_*_graphs.json, writes the PNG
"""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"


def at_24(run: dict) -> dict:
    return next(r for r in run["rows"] if r["rate"] == 24.0)


def main() -> None:
    runs = json.loads((BENCH / "week15_chunked_sweep_graphs.json").read_text())
    runs |= json.loads((BENCH / "week15_chunked_serving_graphs.json").read_text())
    budgets: dict[int, list[dict]] = {}
    for name, run in runs.items():
        if name.startswith("on") and "rows" in run and any(r["rate"] == 24.0 for r in run["rows"]):
            budgets.setdefault(int(name[2:].split("_")[0]), []).append(at_24(run))
    off = [at_24(run) for name, run in runs.items() if name.startswith("off_")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(axes, ("ttft_p50_ms", "itl_p99_ms"), ("TTFT p50", "ITL p99")):
        xs = sorted(budgets)
        for x in xs:
            ax.scatter([x] * len(budgets[x]), [r[key] for r in budgets[x]], color="tab:blue", s=12)
        ax.plot(xs, [statistics.median(r[key] for r in budgets[x]) for x in xs], "o-", label="chunked, median")
        lo, hi = min(r[key] for r in off), max(r[key] for r in off)
        ax.axhspan(lo, hi, color="tab:gray", alpha=0.3, label="chunking off, range of 3 runs")
        if key == "itl_p99_ms":
            ax.axhline(15, color="tab:red", ls="--", label="target 15 ms")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget per step")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} at 24 req/s, H100")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = BENCH / "week15_budget_sweep.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
