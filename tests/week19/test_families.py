"""Week 19: model families. Mistral, Qwen2, Qwen3 and Gemma 3 checkpoints (tiny, random, built with
transformers in float32) run token for token as HuggingFace runs them: the registry picks the class,
the config reader the options, and the engine (paged cache, continuous batching, prefix caching,
chunked prefill, the Triton kernel through its interpreter) never knows which family it runs.

Every prompt of the engine tests is longer than the sliding window of 8, so the window matters:
`test_the_window_changes_the_answer` checks that it does.
"""

from dataclasses import replace

import pytest
import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.bench.compare import compare_with_hf, first_divergence
from nanoserve.engine.engine import LLM
from nanoserve.model.config import FULL, SLIDING, ConfigError, ModelConfig
from nanoserve.model.gemma import Gemma3
from nanoserve.model.layers import FamilyAttention
from nanoserve.model.llama import Llama
from nanoserve.model.loader import load_model
from nanoserve.model.registry import MODEL_CLASSES, model_class
from nanoserve.model.tensor_parallel import check_shardable
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import FAMILY_CONFIGS, make_family_checkpoint

FAMILIES = ["mistral", "qwen2", "qwen3", "gemma3"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path, hf = make_family_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    return request.param, path, hf


def prompts(n: int = 4):
    gen = torch.Generator().manual_seed(19)
    shared = torch.randint(3, 4096, (20,), generator=gen).tolist()  # a prefix that two prompts share
    own = [torch.randint(3, 4096, (k,), generator=gen).tolist() for k in (13, 29, 9, 41)]
    return [shared + own[0], shared + own[1], own[2], own[3]][:n]


def hf_greedy(hf, prompt, n=10):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


# ----------------------------------------------------------------------------------- the config


@pytest.mark.exercise("family-options")
def test_each_family_reads_its_options(family):
    name, path, hf = family
    config = ModelConfig.from_json(path)
    assert config.architecture == FAMILY_CONFIGS[name][0]
    assert model_class(config) is (Gemma3 if name == "gemma3" else Llama)
    windows = [config.window(i) for i in range(config.num_layers)]
    expected = {"mistral": [8, 8, 8], "gemma3": [8, 8, None]}.get(name, [None] * 3)
    assert windows == expected
    assert config.attention_bias == (name == "qwen2")
    assert config.qk_norm == (name in ("qwen3", "gemma3"))
    assert config.hidden_act == ("gelu_pytorch_tanh" if name == "gemma3" else "silu")
    if name == "gemma3":
        assert config.layer_types == (SLIDING, SLIDING, FULL)
        assert config.rope_local_theta == 100.0 and config.rope_theta == 10000.0
        assert config.attention_scale == 24**-0.5


@pytest.mark.exercise("family-options")
def test_older_gemma3_configs_and_qwen_windows():
    """Configs written before transformers 5 name the kinds of layer by a pattern and the local RoPE
    base by its own key; Qwen's windows start at max_window_layers."""
    raw = dict(architectures=["Gemma3ForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
               num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6,
               max_position_embeddings=64, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=16,
               sliding_window_pattern=6, query_pre_attn_scalar=4)
    config = ModelConfig.from_dict(raw)
    assert [config.window(i) for i in range(7)] == [16] * 5 + [None, 16]
    assert config.rope_theta == 1e6 and config.rope_local_theta == 1e4 and config.tie_word_embeddings
    qwen = dict(raw, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, max_window_layers=5)
    del qwen["sliding_window_pattern"]
    assert [ModelConfig.from_dict(qwen).window(i) for i in range(7)] == [None] * 5 + [16, 16]


@pytest.mark.exercise("family-options")
@pytest.mark.parametrize("change,message", [
    (dict(architectures=["FalconForCausalLM"]), "MistralForCausalLM, Qwen2ForCausalLM"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(hidden_activation="relu"), "relu"),
])
def test_what_no_family_runs_is_refused_by_name(change, message):
    raw = dict(architectures=["Gemma3ForCausalLM"], vocab_size=16, hidden_size=8, intermediate_size=16,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6,
               max_position_embeddings=64, rope_theta=1e6)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw | change)


def test_every_supported_architecture_has_a_class_and_tp_refuses_the_others(family):
    name, path, _ = family
    assert set(MODEL_CLASSES) == {"LlamaForCausalLM", *(a for a, _ in FAMILY_CONFIGS.values())}
    with pytest.raises(ValueError, match="tensor parallelism is written for Llama"):
        check_shardable(ModelConfig.from_json(path), 2)


# ----------------------------------------------------------------------------------- the model


@pytest.mark.exercise("family-options", "family-attention", "gemma-layer")
@torch.no_grad()
def test_hidden_states_and_logits_match_hf(family):
    name, path, hf = family
    ours = load_model(path)
    ids = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(1))
    expected = hf(ids[None], output_hidden_states=True)
    states: list[torch.Tensor] = []
    hidden = ours(ids, torch.arange(len(ids)), PrefillContext([len(ids)]), hidden_states_out=states)
    for i, (a, b) in enumerate(zip(states[:-1], expected.hidden_states[:-1])):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b[0], atol=1e-5 * scale, rtol=1e-5, msg=f"{name}: after layer {i - 1}")
    torch.testing.assert_close(ours.compute_logits(hidden), expected.logits[0], atol=1e-4, rtol=1e-5)


@torch.no_grad()
def test_the_window_changes_the_answer(family):
    """Without its window (or Gemma's scale, or its local RoPE base) a family's logits differ: the
    tests above would catch a context that ignored them."""
    name, path, _ = family
    ours = load_model(path)
    ids = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(2))
    logits = ours.compute_logits(ours(ids, torch.arange(30), PrefillContext([30])))
    attns = [m for m in ours.modules() if isinstance(m, FamilyAttention)]
    if name == "qwen2":  # nothing to switch off but the biases: they are in the projection
        assert not attns and ours.layers[0].self_attn.qkv_proj.bias is not None
        return
    for attn in attns:
        attn.window, attn.scale = None, None
        if name == "qwen3":
            attn.q_norm = attn.k_norm = torch.nn.Identity()
    plain = ours.compute_logits(ours(ids, torch.arange(30), PrefillContext([30])))
    assert (plain - logits).abs().max() > 1e-2


def test_compare_tool_for_each_family(family):
    name, path, _ = family
    ids = torch.randint(0, 4096, (17,), generator=torch.Generator().manual_seed(3)).tolist()
    diffs = compare_with_hf(str(path), ids)
    assert first_divergence(diffs) is None, diffs
    assert len(diffs) == 3 + 2  # embeddings, 2 of 3 layers (the last is compared after the norm), norm, logits


# ----------------------------------------------------------------------------------- the engine


@pytest.mark.exercise("family-options", "family-attention", "gemma-layer")
def test_engine_greedy_equals_hf(family):
    """The paged engine with continuous batching, prefix caching and chunked prefill (a budget of
    16 tokens cuts every prompt): HF's tokens, and the shared prefix found in the cache."""
    name, path, hf = family
    llm = LLM(str(path), dtype=torch.float32, device="cpu", num_blocks=64, block_size=4, max_num_seqs=4,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)
    outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert outs == [hf_greedy(hf, p) for p in prompts()]
    again = [o.token_ids for o in llm.generate(prompts()[:1], GREEDY)]
    assert again == outs[:1] and llm.engine.prefix_cache_stats()["hit_tokens"] > 0
    assert llm.engine.scheduler.allocator.num_free == 64


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
@pytest.mark.slow
def test_triton_kernel_with_windows_equals_hf(name, tmp_path):
    """The paged-attention kernel (through Triton's interpreter on the CPU) with sliding windows,
    the fused kernels swapped in (Gemma's GELU MLP keeps its own code), mixed chunked steps."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package: pip install triton (Linux)")
    path, hf = make_family_checkpoint(tmp_path / "ckpt", name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(path), dtype=torch.float32, device=device, attention_backend="triton", num_blocks=64, block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=4, fused_kernels=True,
              cuda_graphs=False)
    ps = prompts(2)
    outs = [o.token_ids for o in llm.generate(ps, replace(GREEDY, max_tokens=6))]
    hf = hf.to(device)
    assert outs == [hf_greedy(hf, p, 6) for p in ps]


@pytest.mark.gpu
def test_each_family_on_the_gpu(family):
    """The GPU path: Triton compiled (sliding windows included), fused kernels, CUDA graphs for the
    decode steps and the mixed ones. Float32: HF's tokens. Bf16: the engine's greedy tokens against
    HF's bf16 model's, to a tolerance (bf16 rounds differently in the two)."""
    name, path, hf = family
    ps = prompts()
    common = dict(num_blocks=128, block_size=16, max_num_seqs=4, enable_chunked_prefill=True,
                  max_num_batched_tokens=32, max_model_len=256)
    f32 = LLM(str(path), dtype=torch.float32, device="cuda", **common)
    assert f32.engine.attention_backend == "triton" and f32.engine.runner.graphs is not None
    hf32 = hf.to("cuda")
    expected = [hf_greedy_on(hf32, p) for p in ps]
    assert [o.token_ids for o in f32.generate(ps, GREEDY)] == expected
    del f32
    bf16 = LLM(str(path), dtype=torch.bfloat16, device="cuda", **common)
    assert all(len(o.token_ids) == 10 for o in bf16.generate(ps, GREEDY))  # the bf16 graphs run
    model = bf16.engine.model
    agree, rows = 0, 0
    with torch.no_grad():
        for ids in ps:  # bf16 logits of every position against HF's float32 ones
            logits = model.compute_logits(model(torch.tensor(ids, device="cuda"), torch.arange(len(ids), device="cuda"),
                                                PrefillContext([len(ids)]))).float()
            ref = hf32(torch.tensor([ids], device="cuda")).logits[0].float()
            assert (logits.softmax(-1) - ref.softmax(-1)).abs().sum(-1).max() < 0.15  # total variation
            agree, rows = agree + (logits.argmax(-1) == ref.argmax(-1)).sum().item(), rows + len(ids)
    assert agree / rows >= 0.9  # random tiny models have near-ties that bf16 flips; a wrong layer agrees ~never
    hf.to("cpu")


def hf_greedy_on(hf, prompt, n=10):
    device = next(hf.parameters()).device
    out = hf.generate(torch.tensor([prompt], device=device), attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                      device=device), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()
