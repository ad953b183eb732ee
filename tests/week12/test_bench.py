"""Week 12: `nanoserve bench` runs end to end (--quick, the bundled tiny model).

The figures themselves only mean something on the Llama-3.2-1B shape on a GPU
(docs/benchmarks.md); here the three benchmarks must run, side by side with HuggingFace (and, for
latency, the static-cache baseline), and
write complete, consistent results. On a CUDA machine it runs on the GPU (CUDA graphs included).
"""

import json

import pytest
import torch

from nanoserve.cli import main

pytest.importorskip("httpx", reason="the serving benchmark's client needs httpx: pip install -e '.[dev]'")


@pytest.mark.slow
def test_bench_all_quick(tmp_path, capsys):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert main(["bench", "all", "--quick", "--device", device, "--out", str(tmp_path), "--port", "8479"]) == 0
    out = capsys.readouterr().out
    assert "batch-1 decode" in out and "offline throughput" in out and "serving" in out

    latency = json.loads((tmp_path / "latency.json").read_text())
    ours, baseline, hf = latency["rows"]
    assert ours["engine"].startswith("nanoserve") and hf["engine"] == "HF transformers generate"
    assert "static cache" in baseline["engine"]  # issue 20's yardstick (compiled on a GPU)
    for row in (ours, baseline):
        assert row["min_tok_s"] <= row["tok_s"] <= row["max_tok_s"]
    assert ours["tok_s"] > 0 and hf["tok_s"] > 0 and latency["roofline_tok_s"] > 0
    assert abs(ours["ms_per_token"] * ours["tok_s"] - 1000) < 1e-6
    assert set(latency["step_breakdown_ms"]) == {"schedule", "forward", "sample", "update"}

    throughput = json.loads((tmp_path / "throughput.json").read_text())
    ours, hf = throughput["rows"]
    assert throughput["num_requests"] == 8 and ours["steps"] > 0 and hf["engine"] == "HF transformers generate_batch"
    assert ours["vs_hf"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"])
    split = throughput["time_split"]
    assert split["prefill_steps"] >= 1 and split["decode_step_seconds"] > 0

    serving = json.loads((tmp_path / "serving.json").read_text())
    (row,) = serving["rows"]
    assert row["rate"] == 4.0 and row["requests"] == 6
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    for name in ("latency", "throughput", "serving"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_bench_serving_forwards_every_engine_option_to_the_server():
    """`bench serving` starts `nanoserve serve`: the engine options given to bench must reach it."""
    import argparse

    from nanoserve.bench.cli import add_arguments
    from nanoserve.bench.serving import engine_options
    from nanoserve.cli import build_parser
    from nanoserve.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["serving", "--block-size", "8", "--num-blocks", "99", "--kv-cache-memory", "0.5",
                         "--max-num-seqs", "12", "--max-model-len", "300", "--dtype", "float32",
                         "--batching", "static", "--no-preemption", "--no-cuda-graphs", "--no-fused-kernels",
                         "--enable-prefix-caching", "--enable-chunked-prefill", "--scheduling-policy", "priority",
                         "--gpu-memory-utilization", "0.7", "--attention-backend", "torch", "--device", "cpu",
                         "--distributed-executor", "ray", "--ray-placement", "spread"])
    from nanoserve.server.serve import split_models

    served = build_parser().parse_args(["serve", "--model", args.model] + engine_options(args))
    split_models(served)  # as `nanoserve serve` does: --model may name several (issue 38)
    assert EngineConfig.from_args(served) == EngineConfig.from_args(args)


def test_every_engine_field_but_trace_is_a_command_line_option():
    """`EngineConfig.from_args` reads the fields by name: a new field needs an option of the same
    name (`trace` is set from code only), and the options' defaults are the fields'."""
    import argparse
    import dataclasses

    from nanoserve.engine.config import EngineConfig

    from nanoserve.cli import build_parser

    # Issue 35: an instance's role in a disaggregated pair is an option of `serve` alone.
    serve_only = {"kv_role", "kv_connector", "kv_address", "kv_transfer_timeout"}
    p = argparse.ArgumentParser()
    EngineConfig.add_arguments(p)
    args = p.parse_args([])
    assert {f.name for f in dataclasses.fields(EngineConfig)} - set(vars(args)) == {"trace"} | serve_only
    served = vars(build_parser().parse_args(["serve"]))
    assert serve_only <= set(served)
    assert EngineConfig.from_args(argparse.Namespace(**served)) == EngineConfig(model=served["model"])
    assert EngineConfig.from_args(args) == EngineConfig()
    args = p.parse_args(["--dtype", "bfloat16", "--kv-cache-memory", "0.5", "--batching", "static"])
    config = EngineConfig.from_args(args)
    assert (config.dtype, config.kv_cache_memory, config.batching) == (torch.bfloat16, 2**29, "static")


def test_runs_is_honoured_by_latency_and_refused_elsewhere(tmp_path, capsys):
    """`--runs` sets how many batch-1 runs latency times (issue 20); the other benchmarks have
    no such count, so they refuse it rather than ignore it."""
    assert main(["bench", "latency", "--quick", "--device", "cpu", "--no-hf", "--no-baseline", "--runs", "3",
                 "--out", str(tmp_path)]) == 0
    assert len(json.loads((tmp_path / "latency.json").read_text())["runs_tok_s"]) == 3
    for argv in (["throughput", "--runs", "3"], ["latency", "--runs", "1"], ["serving", "--check", "capstone-cpu",
                                                                           "--runs", "3"]):
        capsys.readouterr()
        assert main(["bench", *argv, "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 2
        assert "--runs" in capsys.readouterr().err


# ------------------------------------------- on/off comparisons: fresh processes, alternated (issue 31)


def test_the_settings_alternate():
    from nanoserve.bench.alternate import schedule

    assert schedule(["off", "on"], 3) == [("off", 1), ("on", 1), ("off", 2), ("on", 2), ("off", 3), ("on", 3)]
    assert schedule(["on"], 2) == [("on", 1), ("on", 2)]


def test_every_run_is_a_fresh_process_and_the_runs_alternate():
    """Each run's measurement returns when (time.time) and where (os.getpid) it ran: the runs of A
    and B interleave A B A B ..., and no two share a process, nor with the parent."""
    import os
    import time

    from nanoserve.bench.alternate import run_alternated

    when = run_alternated(time.time, {"A": (), "B": ()}, repeats=3, timeout=120)
    assert [len(when["A"]), len(when["B"])] == [3, 3]
    order = sorted((t, label) for label, times in when.items() for t in times)
    assert [label for _, label in order] == ["A", "B"] * 3
    where = run_alternated(os.getpid, {"A": (), "B": ()}, repeats=2, timeout=120)
    pids = where["A"] + where["B"]
    assert len(set(pids)) == 4 and os.getpid() not in pids


def test_the_median_and_the_spread():
    from nanoserve.bench.alternate import as_json, summarize, with_spread

    runs = [dict(tok_s=1260.0, n=5, hit=None, name="copy"), dict(tok_s=1200.0, n=5, hit=None, name="copy"),
            dict(tok_s=1234.0, n=5, hit=None, name="copy")]
    s = summarize(runs)
    assert s.median == dict(tok_s=1234.0, n=5, hit=None, name="copy") and isinstance(s.median["n"], int)
    assert s.spread == dict(tok_s=(1200.0, 1260.0), n=(5, 5))  # numbers only
    assert with_spread(s, "tok_s", ",.0f") == "1,234 (1,200–1,260)"
    assert with_spread(s, "n", "d") == "5"  # the runs agree: the value alone
    assert with_spread(s, "hit", ".2f") is None  # no value: an empty cell
    assert summarize([dict(x=1), dict(x=2)]).median["x"] == 1.5  # an even count: the mean of the middle two
    assert summarize([dict(x=3), dict(x=8), dict(x=4), dict(x=100)]).median["x"] == 6.0
    assert summarize([dict(x=True), dict(x=False)]).median["x"] is True  # a flag is no number
    j = as_json(s, leave_out=("name",))
    assert j["tok_s"] == 1234.0 and j["spread"]["tok_s"] == [1200.0, 1260.0] and "name" not in j
    assert [r["tok_s"] for r in j["runs"]] == [1260.0, 1200.0, 1234.0]  # every run, in the order they ran


def test_a_hung_run_is_killed_and_named():
    import multiprocessing
    import time

    from nanoserve.bench.alternate import RunTimeout, run_alternated

    start = time.monotonic()
    with pytest.raises(RunTimeout, match=r"slow side, run 1 of 2 sent no result within 1 s"):
        run_alternated(time.sleep, {"slow side": (600,)}, repeats=2, timeout=1, what="test")
    assert time.monotonic() - start < 60
    assert multiprocessing.active_children() == []  # killed, not left behind


def test_a_failing_run_brings_back_its_traceback():
    from nanoserve.bench.alternate import run_alternated

    with pytest.raises(RuntimeError, match=r"(?s)bad, run 1 of 1 failed in its process.*ValueError"):
        run_alternated(int, {"bad": ("not a number",)}, repeats=1, timeout=120)
    with pytest.raises(ValueError, match="--repeats 0"):
        run_alternated(int, {"bad": ("1",)}, repeats=0)


def test_repeats_is_refused_where_nothing_is_compared(tmp_path, capsys):
    for argv in (["latency"], ["throughput"], ["all"], ["serving", "--check", "capstone-cpu"]):
        capsys.readouterr()
        assert main(["bench", *argv, "--repeats", "2", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 2
        assert "--repeats" in capsys.readouterr().err
