"""Week 14: `nanoserve bench prefix` runs end to end on the CPU (--quick, the bundled tiny model)."""

import json

from nanoserve.cli import main


def test_bench_prefix_quick(tmp_path):
    assert main(["bench", "prefix", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "prefix_caching.json").read_text())
    rows = {(r["workload"], r["caching"]): r for r in result["rows"]}
    assert set(rows) == {(w, c) for w in ("shared-prefix", "multi-turn", "random") for c in (False, True)}
    for (workload, caching), row in rows.items():
        assert row["output_tok_s"] > 0 and row["prefilled_tokens"] >= 1
        assert (row["hit_rate"] is None) == (not caching)
    # Multi-turn chats resend their history: with caching, less is prefilled, by exactly the hits.
    off, on = rows["multi-turn", False], rows["multi-turn", True]
    assert on["requests"] == off["requests"] == 6 and on["prompt_tokens"] == off["prompt_tokens"]
    assert on["hit_rate"] > 0 and on["prefilled_tokens"] == off["prefilled_tokens"] - round(on["hit_rate"] * on["prompt_tokens"])
    # Random prompts share nothing: the same tokens are prefilled either way.
    assert rows["random", True]["prefilled_tokens"] == rows["random", False]["prefilled_tokens"]
    assert (tmp_path / "prefix_caching.png").stat().st_size > 0


def test_bench_prefix_one_side_only(tmp_path):
    """--caching on|off builds one engine per workload, so the two sides can run in separate processes."""
    assert main(["bench", "prefix", "--quick", "--device", "cpu", "--workloads", "random", "--caching", "on",
                 "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "prefix_caching.json").read_text())["rows"]
    assert row["workload"] == "random" and row["caching"] is True and "throughput_vs_off" not in row
