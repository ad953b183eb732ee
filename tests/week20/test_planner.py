"""The parallelism planner (nanoserve/engine/planner.py): TP, PP and DP from a model's config and a
machine, on made-up machines and configs (no weights, no GPU).

What is checked: the parameter count equals HuggingFace's `num_parameters()` and nanoserve's own
model's, exactly; each plan is the one its cost model asks for, shown by redoing the arithmetic
here (the split chosen fits, the smaller ones do not); what refuses tensor parallelism gets none;
a model that fits nowhere and bad machine numbers are one-line errors; `nanoserve plan` prints the
table and its reasons; `--parallel auto` writes the sizes into serve's arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanoserve.cli import build_parser, main
from nanoserve.engine import planner
from nanoserve.engine.planner import (
    ACTIVATION_RESERVE,
    GB,
    MIN_SEQUENCES,
    NCCL_ALLREDUCE_S,
    Machine,
    apply_plan,
    auto_parallel,
    count_parameters,
    decode_step_seconds,
    kv_bytes_per_token,
    make_plan,
    pipeline_bubble,
    read_model_config,
)
from nanoserve.model.config import ModelConfig
from nanoserve.model.registry import build_model
from nanoserve.server.data_parallel import replica_argv
from nanoserve.testing import (
    FAMILY_CONFIGS,
    make_family_model,
    make_hf_model,
    tiny_config,
)

# Shapes from the models' published config.json files (Llama-3.2-1B is DESIGN.md's reference shape).
LLAMA_1B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True)
LLAMA_70B = LLAMA_1B | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                            head_dim=128, tie_word_embeddings=False)
GEMMA3_27B = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                  num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072)
BF16 = 2


def config(raw: dict) -> ModelConfig:
    return ModelConfig.from_dict(raw)


def need_per_gpu(raw: dict, tp: int, pp: int, length: int) -> float:
    """What one GPU of a TP x PP split must hold, redone here from the config's numbers: its share
    of the bf16 weights, the activation reserve, and KV for MIN_SEQUENCES sequences of `length`
    (2 vectors x its layers x its KV heads, one at least, x head_dim x 2 bytes)."""
    weights = count_parameters(config(raw)) * BF16 / (tp * pp)
    layers = -(-raw["num_hidden_layers"] // pp)
    kv_heads = max(raw["num_key_value_heads"] // tp, 1)
    kv = MIN_SEQUENCES * length * 2 * layers * kv_heads * raw["head_dim"] * BF16
    return weights + ACTIVATION_RESERVE + kv


# ---------------------------------------------------------------------------- counting


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_transformers_num_parameters(tied):
    raw = tiny_config(tie_word_embeddings=tied, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=8, intermediate_size=96)
    hf = make_hf_model(raw)
    assert count_parameters(ModelConfig.from_dict(hf.config.to_dict())) == hf.num_parameters()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_parameter_count_of_each_family(family):
    """Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma 3's four norms a layer: as
    transformers counts them, and as nanoserve's own model (built on the meta device) holds them."""
    hf = make_family_model(family, tie_word_embeddings=family != "qwen2")
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    assert count_parameters(cfg) == hf.num_parameters()
    with torch.device("meta"):
        ours = build_model(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in ours.parameters())  # a tied matrix counts once


def test_kv_bytes_per_token_shrink_with_tp_until_each_rank_has_one_kv_head():
    cfg = config(LLAMA_1B)  # 16 layers, 8 KV heads of 64
    assert kv_bytes_per_token(cfg, BF16) == 2 * 16 * 8 * 64 * BF16
    assert kv_bytes_per_token(cfg, BF16, tp=2) == kv_bytes_per_token(cfg, BF16) // 2
    assert kv_bytes_per_token(cfg, BF16, tp=16) == kv_bytes_per_token(cfg, BF16, tp=8)  # replicated past 8
    assert kv_bytes_per_token(cfg, BF16, pp=3) == 2 * 6 * 8 * 64 * BF16  # the largest stage: ceil(16 / 3)


# ---------------------------------------------------------------------------- plans


@pytest.mark.exercise("make-plan")
def test_1b_on_one_gpu_is_not_split():
    plan = make_plan(config(LLAMA_1B), Machine(gpus=1, gpus_per_node=1))
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 1)
    assert need_per_gpu(LLAMA_1B, 1, 1, 131072) <= plan.machine.budget
    assert plan.split.need == pytest.approx(need_per_gpu(LLAMA_1B, 1, 1, 131072))


@pytest.mark.exercise("make-plan")
def test_1b_on_eight_gpus_is_eight_replicas():
    plan = make_plan(config(LLAMA_1B), Machine(gpus=8, gpus_per_node=8))
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 8)


@pytest.mark.exercise("make-plan")
def test_70b_on_one_node_of_eight_takes_the_smallest_tp_that_fits():
    machine = Machine(gpus=8, gpus_per_node=8)
    plan = make_plan(config(LLAMA_70B), machine)
    # The arithmetic: 4 GPUs are too few for the weights and KV of 4 x 131072 tokens, 8 are enough.
    assert need_per_gpu(LLAMA_70B, 4, 1, 131072) > machine.budget >= need_per_gpu(LLAMA_70B, 8, 1, 131072)
    assert (plan.tp, plan.pp, plan.dp) == (8, 1, 1)
    # With shorter sequences 4 GPUs suffice, and the other 4 serve as a second copy.
    assert need_per_gpu(LLAMA_70B, 2, 1, 8192) > machine.budget >= need_per_gpu(LLAMA_70B, 4, 1, 8192)
    short = make_plan(config(LLAMA_70B), machine, max_model_len=8192)
    assert (short.tp, short.pp, short.dp) == (4, 1, 2)


@pytest.mark.exercise("make-plan")
def test_70b_on_two_nodes_of_four_pipelines_across_them():
    machine = Machine(gpus=8, gpus_per_node=4)
    plan = make_plan(config(LLAMA_70B), machine)
    assert need_per_gpu(LLAMA_70B, 4, 1, 131072) > machine.budget >= need_per_gpu(LLAMA_70B, 4, 2, 131072)
    assert (plan.tp, plan.pp, plan.dp) == (4, 2, 1)
    assert not any(r.startswith("TP 8") for r in plan.reasons), "TP never leaves a node"


@pytest.mark.exercise("make-plan")
def test_a_model_that_fits_nowhere_says_what_it_needs():
    machine = Machine(gpus=2, gpus_per_node=2)
    with pytest.raises(ValueError) as e:
        make_plan(config(LLAMA_70B), machine)
    message = str(e.value)
    assert "\n" not in message and "does not fit on 2 GPUs of 80 GB" in message
    total = count_parameters(config(LLAMA_70B)) * BF16 + MIN_SEQUENCES * 131072 * kv_bytes_per_token(
        config(LLAMA_70B), BF16)
    assert f"{total / GB:.1f} GB of weights and KV in all" in message
    assert f"{need_per_gpu(LLAMA_70B, 2, 1, 131072) / GB:.2f} GB a GPU" in message


@pytest.mark.exercise("make-plan")
def test_families_that_refuse_tp_get_pipeline_stages():
    """Week 18's sharding is written for Llama: Gemma 3 (27B shape) gets PP, never TP."""
    machine = Machine(gpus=4, gpus_per_node=4, gpu_memory=40 * GB)
    plan = make_plan(config(GEMMA3_27B), machine, max_model_len=4096)
    assert plan.tp == 1 and plan.pp > 1 and plan.dp == 4 // plan.pp
    assert need_per_gpu(GEMMA3_27B, 1, plan.pp // 2, 4096) > machine.budget >= need_per_gpu(GEMMA3_27B, 1, plan.pp, 4096)
    refusals = [r for r in plan.reasons if "refused" in r]
    assert refusals and all("written for Llama checkpoints" in r for r in refusals)
    assert len(refusals) == len({r.split(":")[0] for r in refusals}), "each TP size refused once"


@pytest.mark.exercise("make-plan")
def test_a_family_that_refuses_tp_and_fits_no_pipeline_is_an_error():
    qwen = GEMMA3_27B | dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936)
    with pytest.raises(ValueError, match="does not fit on 1 GPU of 40 GB: split the most this machine allows "
                                         r"\(TP 1 x PP 1\)"):
        make_plan(config(qwen), Machine(gpus=1, gpus_per_node=1, gpu_memory=40 * GB), max_model_len=4096)


@pytest.mark.exercise("make-plan")
def test_the_roofline_and_the_bubble():
    plan = make_plan(config(LLAMA_70B), Machine(gpus=8, gpus_per_node=4))  # TP 4 x PP 2
    read, talk, send = decode_step_seconds(plan)
    weights = count_parameters(config(LLAMA_70B)) * BF16
    assert read == pytest.approx(weights / 4 / 3.35e12)  # the two stages read their halves one after the other
    assert talk == pytest.approx((2 * 80 + 2) * NCCL_ALLREDUCE_S)  # two a layer, embedding, logits
    assert send == pytest.approx(NCCL_ALLREDUCE_S)
    assert pipeline_bubble(1) == 0 and pipeline_bubble(2, 8) == pytest.approx(1 / 9)


# ---------------------------------------------------------------------------- the command line


@pytest.fixture
def config_file(tmp_path: Path):
    def write(raw: dict) -> Path:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(raw))
        return path
    return write


def test_plan_prints_the_table_and_one_reason_per_decision(config_file, capsys):
    path = config_file(LLAMA_70B)
    assert main(["plan", "--model", str(path.parent), "--gpus", "8", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines.index("    TP   PP   DP   GPUs")
    assert lines[header + 1].split() == ["4", "2", "1", "8"]
    assert "2 nodes of 4" in out and "70.55 B parameters" in out
    why = [line for line in lines[lines.index("why:") + 1:]]
    tried = planner.candidate_splits(config(LLAMA_70B), Machine(8, 4))
    considered = tried[: tried.index((4, 2)) + 1]
    assert len(why) == 1 + len(considered) + 1  # the rule, each split tried in order, DP
    assert [w.split(":")[0] for w in why[1:-1]] == [f"  - TP {tp} x PP {pp}" for tp, pp in considered]
    assert "fits" in why[-2] and why[-1].startswith("  - DP 1")


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "--gpus and --gpus-per-node must be at least 1"),
    (["--gpus", "8", "--gpus-per-node", "3"], "8 GPUs do not make whole nodes of 3"),
    (["--gpus", "2", "--gpus-per-node", "4"], "--gpus-per-node 4 is more than --gpus 2"),
    (["--gpus", "2", "--gpu-memory", "-1"], "--gpu-memory and --gpu-bandwidth must be positive"),
    (["--gpus", "1", "--max-model-len", "0"], "--max-model-len must be at least 1"),
    (["--gpus", "1", "--model", "LLAMA_70B"], "does not fit on 1 GPU of 80 GB"),
])
def test_plan_errors_are_one_line(argv, message, config_file, capsys):
    argv = [str(config_file(LLAMA_70B)) if a == "LLAMA_70B" else a for a in argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nanoserve: error: ") and message in err


def test_the_model_is_read_from_a_folder_a_file_or_a_name(config_file):
    path = config_file(LLAMA_1B)
    assert read_model_config(path) == read_model_config(path.parent) == config(LLAMA_1B)
    assert count_parameters(read_model_config("tiny")) > 0  # the bundled model, through resolve_model_dir


def serve_args(*argv: str):
    from nanoserve.server.serve import split_models

    args = build_parser().parse_args(["serve", *argv])
    split_models(args)  # as `nanoserve serve` does before planning: --model may name several (issue 38)
    args.argv = ["serve", *argv]
    return args


def test_parallel_auto_sets_the_sizes_and_the_replicas_argv(config_file):
    args = serve_args("--model", str(config_file(LLAMA_1B).parent), "--parallel", "auto", "--port", "9000")
    plan = auto_parallel(args, Machine(gpus=4, gpus_per_node=4))
    assert (args.tensor_parallel_size, args.data_parallel_size) == (plan.tp, plan.dp) == (1, 4)
    # The front hands its argv on to its replicas: they must run the plan's TP, not plan again.
    again = build_parser().parse_args(replica_argv(args.argv))
    assert again.parallel == "manual" and again.tensor_parallel_size == 1 and again.data_parallel_size == 1

    args = serve_args("--model", str(config_file(LLAMA_70B).parent), "--parallel=auto")
    auto_parallel(args, Machine(gpus=8, gpus_per_node=8))
    assert (args.tensor_parallel_size, args.data_parallel_size) == (8, 1)
    assert "--parallel=auto" not in args.argv


def test_parallel_auto_and_pipeline_parallelism(config_file):
    """PP is set through `pipeline_parallel_size` where the engine has it (another branch adds it);
    where it does not, a plan that needs PP fails rather than run without it."""
    plan = make_plan(config(LLAMA_70B), Machine(gpus=8, gpus_per_node=4))
    args = serve_args("--model", "x", "--parallel", "auto")
    if not hasattr(args, "pipeline_parallel_size"):
        with pytest.raises(ValueError, match="no --pipeline-parallel-size yet"):
            apply_plan(args, plan)
        args.pipeline_parallel_size = 1  # as the option will
    apply_plan(args, plan)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (4, 2, 1)
    assert args.argv[-6:] == ["--tensor-parallel-size", "4", "--data-parallel-size", "1",
                              "--pipeline-parallel-size", "2"]


def test_parallel_auto_refuses_sizes_given_by_hand():
    args = serve_args("--parallel", "auto", "-tp", "2")
    with pytest.raises(ValueError, match="leave out -tp"):
        auto_parallel(args, Machine(gpus=2, gpus_per_node=2))
    args = serve_args("--parallel", "auto", "--data-parallel", "2")  # argparse takes a unique prefix
    with pytest.raises(ValueError, match="leave out --data-parallel"):
        auto_parallel(args, Machine(gpus=2, gpus_per_node=2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
@pytest.mark.parametrize("command", ["serve", "bench"])
def test_parallel_auto_without_a_gpu_is_one_line_before_anything_starts(command, capsys):
    argv = [command, "--parallel", "auto"] + (["latency"] if command == "bench" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--parallel auto plans over GPUs and torch sees none" in err
