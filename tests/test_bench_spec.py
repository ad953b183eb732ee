"""Week 17's benchmark: `nanoserve bench spec` runs end to end on the CPU (--quick, the bundled tiny model).

Here and not in tests/week17: it takes minutes (an engine per process), and a week's folder is
what `pytest tests/week17` and the course's workspace checks run, in seconds.

Speculation off and on are engines in fresh processes, one per run, the two alternated (issue
31): the speed-ups are ratios of the medians over the processes, and the texts of every run, off
and on, must be the same (greedy, float32).
"""

import json

import pytest

from nanoserve.cli import main

pytestmark = pytest.mark.slow  # a fresh process, and an engine, per run


def test_bench_spec_quick(tmp_path, capsys):
    assert main(["bench", "spec", "--quick", "--device", "cpu", "--repeats", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    started = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    assert started == [f"bench spec, speculation: {side}, run {i} of 2, in a fresh process"
                       for i in (1, 2) for side in ("off", "on")]
    result = json.loads((tmp_path / "spec.json").read_text())
    assert result["repeats"] == 2 and result["all_identical"]
    assert [r["workload"] for r in result["rows"]] == ["copy", "chat"]  # --quick: one prompt of each
    for row in result["rows"]:
        assert row["identical"] and row["tokens"] > 1
        assert row["speedup"] == pytest.approx(row["on_tok_s"] / row["off_tok_s"])  # of the medians
        for side in ("off", "on"):
            runs = [r["tok_s"] for r in row[side]["runs"]]
            assert len(runs) == 2 and row[side]["spread"]["tok_s"] == [min(runs), max(runs)]
            assert row[f"{side}_tok_s"] == pytest.approx(sum(runs) / 2)  # two runs: the median is their mean
        assert row["off"]["acceptance"] is None and 0 <= row["acceptance"] <= 1
    assert (tmp_path / "spec.png").stat().st_size > 0


def test_bench_spec_forced_acceptance_and_batch_sweep(tmp_path):
    assert main(["bench", "spec", "--quick", "--device", "cpu", "--repeats", "1", "--forced-acceptance", "0,1",
                 "--out", str(tmp_path)]) == 0
    forced = json.loads((tmp_path / "spec_forced.json").read_text())
    p0, p1 = forced["rows"]
    assert (p0["accept"], p0["tokens_per_step"]) == (0.0, 1.0) and p1["tokens_per_step"] > 2
    assert p1["speedup"] == pytest.approx(p1["tok_s"] / forced["off_tok_s"]) and len(forced["off"]["runs"]) == 1
    assert main(["bench", "spec", "--quick", "--device", "cpu", "--repeats", "1", "--batch-sweep", "2",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "spec_batch.json").read_text())["rows"]
    (row,) = rows
    assert row["batch"] == 2 and row["off_tok_s"] > 0 and row["ratio"] == pytest.approx(row["on_tok_s"] / row["off_tok_s"])
