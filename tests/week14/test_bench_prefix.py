"""Week 14: `nanoserve bench prefix` runs end to end on the CPU (--quick, the bundled tiny model).

Every run of caching off and on is an engine in a fresh process, the two alternated (issue 31);
the rows hold the median of the runs, their range and every run's values.
"""

import json

import pytest

from nanoserve.cli import main

pytestmark = pytest.mark.slow  # a fresh process, and an engine, per run


def test_bench_prefix_quick(tmp_path, capsys):
    assert main(["bench", "prefix", "--quick", "--device", "cpu", "--workloads", "multi-turn", "--repeats", "2",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    started = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    assert started == [f"bench prefix, multi-turn: caching {c}, run {i} of 2, in a fresh process"
                       for i in (1, 2) for c in ("off", "on")]  # alternated
    result = json.loads((tmp_path / "prefix_caching.json").read_text())
    assert result["repeats"] == 2
    rows = {(r["workload"], r["caching"]): r for r in result["rows"]}
    assert list(rows) == [("multi-turn", False), ("multi-turn", True)]
    for (workload, caching), row in rows.items():
        assert len(row["runs"]) == 2 and all(r["caching"] == caching for r in row["runs"])
        for key in ("output_tok_s", "ttft_p50_ms", "prefilled_tokens"):
            low, high = row["spread"][key]
            assert low <= row[key] <= high and sorted(r[key] for r in row["runs"]) == [low, high]
        assert row["output_tok_s"] > 0 and row["prefilled_tokens"] >= 1
        assert (row["hit_rate"] is None) == (not caching)
    # Multi-turn chats resend their history: with caching, less is prefilled, by exactly the hits.
    off, on = rows["multi-turn", False], rows["multi-turn", True]
    assert on["requests"] == off["requests"] == 6 and on["prompt_tokens"] == off["prompt_tokens"]
    assert on["hit_rate"] > 0 and on["prefilled_tokens"] == off["prefilled_tokens"] - round(on["hit_rate"] * on["prompt_tokens"])
    assert on["throughput_vs_off"] == pytest.approx(on["output_tok_s"] / off["output_tok_s"])  # of the medians
    assert on["ttft_p50_speedup"] == pytest.approx(off["ttft_p50_ms"] / on["ttft_p50_ms"])
    assert (tmp_path / "prefix_caching.png").stat().st_size > 0


def test_bench_prefix_one_side_only(tmp_path):
    """--caching on|off measures one side only (each run still in a process of its own)."""
    assert main(["bench", "prefix", "--quick", "--device", "cpu", "--workloads", "shared-prefix,random",
                 "--caching", "on", "--repeats", "1", "--out", str(tmp_path)]) == 0
    shared, random = json.loads((tmp_path / "prefix_caching.json").read_text())["rows"]
    assert (shared["workload"], random["workload"]) == ("shared-prefix", "random")
    for row in (shared, random):
        assert row["caching"] is True and "throughput_vs_off" not in row and len(row["runs"]) == 1
    assert shared["requests"] == 6 and random["requests"] == 8
    # Random prompts share nothing: with caching on, every prompt token is still prefilled.
    assert random["hit_rate"] == 0 and random["prefilled_tokens"] == random["prompt_tokens"]
