"""Week 24: Mixtral and Qwen2-MoE checkpoints (tiny, random, float32) run token for token as
HuggingFace runs them: the registry picks the class, the config reader the experts' rules, the
loader stacks the experts, and the engine (paged cache, continuous batching, prefix caching,
chunked prefill) never knows it runs a mixture, except to count each expert's tokens."""

import pytest
import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.bench.compare import compare_with_hf, first_divergence
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ConfigError, ModelConfig
from nanoserve.model.layers import MLP
from nanoserve.model.loader import load_model
from nanoserve.model.moe import Mixtral, MoEBlock, MoEModel
from nanoserve.model.registry import model_class
from nanoserve.sampling.params import SamplingParams

FAMILIES = ["mixtral", "qwen2_moe"]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(params=FAMILIES)
def family(request, moe_checkpoints):
    return request.param, *moe_checkpoints[request.param]


def test_each_family_reads_its_rules(moe_checkpoints):
    mixtral = ModelConfig.from_json(moe_checkpoints["mixtral"][0])
    assert model_class(mixtral) is Mixtral
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 96)
    assert mixtral.norm_topk_prob and not mixtral.shared_expert_intermediate_size and not mixtral.attention_bias
    assert all(mixtral.is_moe_layer(i) for i in range(3))
    qwen = ModelConfig.from_json(moe_checkpoints["qwen2_moe"][0])
    assert model_class(qwen) is MoEModel
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (16, 4, 32)
    assert not qwen.norm_topk_prob and qwen.shared_expert_intermediate_size == 96 and qwen.attention_bias
    assert qwen.dense_layers == (1,) and [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]
    model = load_model(moe_checkpoints["qwen2_moe"][0])
    assert [type(layer.mlp) for layer in model.layers] == [MoEBlock, MLP, MoEBlock]
    block = model.layers[0].mlp
    assert block.w13.shape == (16, 64, 64) and block.w2.shape == (16, 64, 32) and not hasattr(block, "experts")


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=None), "num_experts_per_tok"),
    (dict(num_experts_per_tok=9), "between 1 and the number of experts"),
    (dict(hidden_act="gelu"), "gelu"),
])
def test_what_the_experts_cannot_run_is_refused_by_name(change, message):
    raw = dict(architectures=["MixtralForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5,
               max_position_embeddings=64, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw | change)


@pytest.mark.exercise("expert-loop")
@torch.no_grad()
def test_hidden_states_and_logits_match_hf(family):
    name, path, hf = family
    ours = load_model(path)
    ids = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(1))
    expected = hf(ids[None], output_hidden_states=True)
    states: list[torch.Tensor] = []
    hidden = ours(ids, torch.arange(len(ids)), PrefillContext([len(ids)]), hidden_states_out=states)
    for i, (a, b) in enumerate(zip(states[:-1], expected.hidden_states[:-1])):
        torch.testing.assert_close(a, b[0], atol=1e-5 * max(1.0, b.abs().max().item()), rtol=1e-5,
                                   msg=f"{name}: after layer {i - 1}")
    torch.testing.assert_close(ours.compute_logits(hidden), expected.logits[0], atol=1e-4, rtol=1e-5)


@pytest.mark.exercise("expert-loop")
@torch.no_grad()
def test_the_routing_rules_matter(moe_checkpoints):
    """Qwen2-MoE without its shared expert, or with Mixtral's renormalization, gives other logits:
    the test above would catch a block that dropped either."""
    model = load_model(moe_checkpoints["qwen2_moe"][0])
    ids = torch.randint(0, 4096, (20,), generator=torch.Generator().manual_seed(2))

    def logits():
        return model.compute_logits(model(ids, torch.arange(20), PrefillContext([20])))

    base = logits()
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    for block in blocks:
        block.renormalize = True
    assert (logits() - base).abs().max() > 1e-2
    for block in blocks:
        block.renormalize, block.shared_expert_gate.weight.data = False, torch.full_like(block.shared_expert_gate.weight, -1e4)
    assert (logits() - base).abs().max() > 1e-2


def test_compare_tool_for_each_family(family):
    name, path, _ = family
    ids = torch.randint(0, 4096, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    diffs = compare_with_hf(str(path), ids)
    assert first_divergence(diffs) is None, diffs


def test_engine_greedy_equals_hf(family, moe_prompts, hf_greedy):
    """Continuous batching, prefix caching and chunked prefill (a budget of 16 tokens cuts every prompt):
    HF's tokens; and every MoE layer counted k token-expert pairs for each token the model ran."""
    name, path, hf = family
    llm = LLM(str(path), dtype=torch.float32, device="cpu", num_blocks=64, block_size=4, max_num_seqs=4,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
    outs = [o.token_ids for o in llm.generate(moe_prompts, GREEDY)]
    assert outs == [hf_greedy(hf, p, 8) for p in moe_prompts]
    again = [o.token_ids for o in llm.generate(moe_prompts[:1], GREEDY)]
    assert again == outs[:1] and llm.engine.prefix_cache_stats()["hit_tokens"] > 0
    config, load = llm.engine.model.config, llm.engine.expert_load()
    ran = llm.engine.scheduler.num_scheduled_tokens
    assert sorted(load) == [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    assert all(sum(counts) == config.num_experts_per_tok * ran for counts in load.values())
    assert all(len(counts) == config.num_experts and sum(c > 0 for c in counts) > 1 for counts in load.values())


@pytest.mark.gpu
def test_each_family_on_the_gpu(family, moe_prompts, hf_greedy):
    """The GPU path as served: Triton compiled, the grouped expert kernels, CUDA graphs capturing MoE
    decode and mixed steps (the alignment reads nothing on the host). Float32: HF's tokens; the routing
    counted for real tokens and graph padding alike (at least k pairs per token run)."""
    name, path, hf = family
    llm = LLM(str(path), dtype=torch.float32, device="cuda", num_blocks=128, block_size=16, max_num_seqs=4,
              enable_chunked_prefill=True, max_num_batched_tokens=32, max_model_len=256)
    assert llm.engine.runner.graphs is not None
    hf = hf.to("cuda")
    expected = []
    for p in moe_prompts:
        out = hf.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                          device="cuda"), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    hf.to("cpu")
    assert [o.token_ids for o in llm.generate(moe_prompts, GREEDY)] == expected
    config, ran = llm.engine.model.config, llm.engine.scheduler.num_scheduled_tokens
    assert all(sum(c) >= config.num_experts_per_tok * ran for c in llm.engine.expert_load().values())
