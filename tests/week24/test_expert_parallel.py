"""Week 24: expert parallelism. Two CPU ranks over gloo, each holding half the experts, tokens sent
to their experts and back with all_to_all_single: the same tokens as one rank (and as HF), the same
routing counts on the driver; a router that sends every token to the first rank's experts (the
second rank's experts get nothing); and what expert parallelism refuses, before any process starts."""

import pytest
import torch

from nanoserve.cli import build_parser
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.model.expert_parallel import check_expert_parallel
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_family_model, save_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
COMMON = dict(dtype=torch.float32, device="cpu", num_blocks=64, block_size=4, max_num_seqs=4,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)


def run(path, prompts, **kwargs) -> tuple[list[list[int]], dict]:
    with LLM(str(path), **COMMON, **kwargs) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        alone = [o.token_ids for o in llm.generate(prompts[2:3], GREEDY)]  # one sequence: steps of one token
        return outs + alone, llm.engine.expert_load()


def test_two_ranks_equal_one_and_hf(moe_checkpoints, moe_prompts, hf_greedy):
    """Qwen2-MoE (16 experts: 8 a rank, a shared expert and a dense layer replicated), batches of
    ragged prompts, chunked, cached prefixes, then a lone sequence whose decode steps leave rank 1
    no token of its own."""
    path, hf = moe_checkpoints["qwen2_moe"]
    one, load_one = run(path, moe_prompts)
    two, load_two = run(path, moe_prompts, expert_parallel_size=2)
    assert two == one == [hf_greedy(hf, p, 6) for p in moe_prompts + moe_prompts[2:3]]
    assert load_two == load_one  # the driver routes every token, so its counts are the whole engine's


def test_every_token_to_the_first_ranks_experts(tmp_path, moe_prompts):
    """A Mixtral whose routers are zero: every token ties, and goes to experts 0 and 1, both on rank 0."""
    hf = make_family_model("mixtral")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.zero_()
    path = save_checkpoint(hf, tmp_path / "ckpt")
    one, load_one = run(path, moe_prompts[:2])
    two, load_two = run(path, moe_prompts[:2], expert_parallel_size=2)
    assert two == one and load_two == load_one
    assert all(counts[2:] == [0] * 6 and counts[0] == counts[1] > 0 for counts in load_two.values())


@pytest.mark.parametrize("options,message", [
    (dict(expert_parallel_size=2, tensor_parallel_size=2), "not combined with --tensor-parallel-size"),
    (dict(expert_parallel_size=2, pipeline_parallel_size=2), "not combined with --tensor-parallel-size"),
    (dict(expert_parallel_size=2, cuda_graphs=True), "run eagerly"),
    (dict(expert_parallel_size=0), "1 \\(off\\) or more"),
])
def test_what_expert_parallelism_refuses(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_models_it_cannot_split_are_refused_before_any_process_starts(moe_checkpoints):
    with pytest.raises(ValueError, match="is a dense model"):
        LLM("tiny", device="cpu", expert_parallel_size=2)
    mixtral = ModelConfig.from_json(moe_checkpoints["mixtral"][0])
    with pytest.raises(ValueError, match="8 experts of each layer to split evenly"):
        check_expert_parallel(mixtral, 3)
    check_expert_parallel(mixtral, 4)
    with pytest.raises(ValueError, match="not supported for mixtures of experts"):
        LLM(str(moe_checkpoints["mixtral"][0]), device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="LoRA adapters on a mixture of experts"):
        LLM(str(moe_checkpoints["mixtral"][0]), device="cpu", max_loras=1)


def test_the_flag():
    parser = build_parser()
    for argv in (["generate", "x", "--expert-parallel-size", "2"], ["serve", "-ep", "2"]):
        config = EngineConfig.from_args(parser.parse_args(argv))
        assert config.expert_parallel_size == 2 and config.world_size == 2
    assert EngineConfig.from_args(parser.parse_args(["chat"])).expert_parallel_size == 1


@pytest.mark.gpu
def test_two_gpus_equal_one(moe_checkpoints, moe_prompts):
    """EP=2 over NCCL on two GPUs (eager steps, the grouped kernels on each rank's experts): EP=1's tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    path, _ = moe_checkpoints["qwen2_moe"]
    gpu = dict(COMMON, device="cuda")
    with LLM(str(path), **gpu) as llm:
        one = [o.token_ids for o in llm.generate(moe_prompts, GREEDY)]
    with LLM(str(path), **gpu, expert_parallel_size=2) as llm:
        assert llm.engine.runner.graphs is None
        assert [o.token_ids for o in llm.generate(moe_prompts, GREEDY)] == one
