"""Issue 35's measurement: `nanoserve bench serving` in front of a disaggregated pair reports the KV
each rate moved, read from the decode instance's /metrics before and after the rate."""

from __future__ import annotations

import json

import pytest

from nanoserve.bench.serving import kv_transfer_row
from nanoserve.cli import main
from nanoserve.testing import free_ports

pytest.importorskip("httpx", reason="the serving benchmark's client needs httpx: pip install -e '.[dev]'")


def test_the_transfer_row_is_the_difference_of_two_readings():
    before = dict(count=2.0, bytes=4e9, seconds=1.0)
    after = dict(count=6.0, bytes=12e9, seconds=3.0)
    row = kv_transfer_row(before, after)
    assert row == dict(kv_transfers=4, kv_gb=8.0, kv_ms_per_transfer=500.0, kv_gb_per_s=4.0)
    assert kv_transfer_row(None, after) == {}  # not a pair: no columns


@pytest.mark.slow
def test_bench_serving_on_a_pair_counts_each_rates_transfers(tmp_path, capsys):
    port, kv_port = free_ports(3), free_ports(1)
    assert main(["bench", "serving", "--model", "tiny", "--device", "cpu", "--out", str(tmp_path),
                 "--port", str(port), "--rates", "4,8", "--requests", "3", "--lengths", "16,24",
                 "--output-len", "3,5", "--server-args", f"--disaggregated --kv-address 127.0.0.1:{kv_port}"]) == 0
    rows = json.loads((tmp_path / "serving.json").read_text())["rows"]
    assert [r["rate"] for r in rows] == [4.0, 8.0]
    for row in rows:
        # every request was split (prompts of 16-24 tokens, 3-5 out), the warm-up's not counted
        assert row["kv_transfers"] == 3 and row["kv_gb"] > 0 and row["kv_ms_per_transfer"] > 0
    assert "ms a transfer" in capsys.readouterr().out


def test_the_transfer_benchmark_runs_on_the_cpu(capsys):
    """`scripts/bench_kv_transfer.py --device cpu` (the two-GPU link figure's smoke test): gloo
    between two pools, the last transfer checked bit for bit, a row per prompt length."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_kv_transfer.py"
    spec = importlib.util.spec_from_file_location("bench_kv_transfer", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--shape", "tiny", "--tokens", "32", "80", "--repeats", "2"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("gloo")]
    assert [int(line[1]) for line in lines] == [32, 80]
    # K and V, 2 layers, 80 tokens (5 blocks of 16), 2 heads of 16 float32s
    assert float(lines[1][2]) == pytest.approx(2 * 2 * 80 * 2 * 16 * 4 / 2**20, abs=1e-3)
