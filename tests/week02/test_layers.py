"""Week 2: attention, MLP and the decoder block, each against HuggingFace's module."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRotaryEmbedding,
)

from nanoserve.attention.base import PrefillContext, causal_attention
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import MLP, Attention, DecoderLayer, RotaryEmbedding
from nanoserve.testing import tiny_config

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def configs(kind):
    heads, kv = HEADS[kind]
    raw = tiny_config(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=64, head_dim=16)
    hf_cfg = LlamaConfig(**raw)
    hf_cfg._attn_implementation = "eager"
    return hf_cfg, ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **hf_cfg.to_dict()})


def copy_attention(ours: Attention, theirs: LlamaAttention):
    with torch.no_grad():
        torch.nn.init.normal_(theirs.q_proj.weight, std=0.2)
        torch.nn.init.normal_(theirs.k_proj.weight, std=0.2)
        torch.nn.init.normal_(theirs.v_proj.weight, std=0.2)
        ours.qkv_proj.weight.copy_(torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]))
        ours.o_proj.weight.copy_(theirs.o_proj.weight)


def copy_mlp(ours: MLP, theirs: LlamaMLP):
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
        ours.down_proj.weight.copy_(theirs.down_proj.weight)


def hf_causal_mask(T):
    return torch.full((T, T), float("-inf")).triu(1)[None, None]


@pytest.mark.exercise("causal-attention")
@pytest.mark.parametrize("kind", HEADS)
def test_causal_attention_reference_equals_sdpa(kind):
    heads, kv = HEADS[kind]
    T, D = 11, 16
    q, k, v = torch.randn(T, heads, D), torch.randn(T, kv, D), torch.randn(T, kv, D)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(heads // kv, 1).transpose(0, 1),
        v.repeat_interleave(heads // kv, 1).transpose(0, 1), is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(causal_attention(q, k, v), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("causal-attention")
def test_causal_attention_with_offset_sees_the_past():
    """Queries at positions 5..7 against keys 0..7: the last 3 rows of full attention."""
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    full = causal_attention(q, k, v)
    torch.testing.assert_close(causal_attention(q[5:], k, v, q_start=5), full[5:])


@pytest.mark.exercise("attention")
@pytest.mark.parametrize("kind", HEADS)
def test_attention_matches_hf(kind):
    hf_cfg, cfg = configs(kind)
    theirs = LlamaAttention(hf_cfg, layer_idx=0).eval()
    ours = Attention(cfg, layer_idx=0)
    copy_attention(ours, theirs)
    T = 13
    x = torch.randn(T, cfg.hidden_size)
    positions = torch.arange(T)
    cos, sin = RotaryEmbedding(cfg)(positions, x.dtype)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(x[None], positions[None])
    with torch.no_grad():
        expected, _ = theirs(x[None], position_embeddings=(hf_cos, hf_sin), attention_mask=hf_causal_mask(T))
        out = ours(x, cos, sin, PrefillContext([T]))
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("prefill-context")
def test_packed_sequences_do_not_see_each_other():
    hf_cfg, cfg = configs("gqa")
    attn = Attention(cfg, layer_idx=0)
    lens = [5, 1, 9]
    xs = [torch.randn(n, cfg.hidden_size) for n in lens]
    rope = RotaryEmbedding(cfg)
    positions = torch.cat([torch.arange(n) for n in lens])
    cos, sin = rope(positions, torch.float32)
    with torch.no_grad():
        packed = attn(torch.cat(xs), cos, sin, PrefillContext(lens))
        alone = [attn(x, *rope(torch.arange(len(x)), torch.float32), PrefillContext([len(x)])) for x in xs]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-6, rtol=1e-6)


@pytest.mark.exercise("swiglu")
def test_mlp_matches_hf():
    hf_cfg, cfg = configs("gqa")
    theirs, ours = LlamaMLP(hf_cfg), MLP(cfg)
    copy_mlp(ours, theirs)
    x = torch.randn(7, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)


@pytest.mark.exercise("decoder-layer")
@pytest.mark.parametrize("kind", HEADS)
def test_decoder_layer_matches_hf(kind):
    hf_cfg, cfg = configs(kind)
    theirs, ours = LlamaDecoderLayer(hf_cfg, layer_idx=0).eval(), DecoderLayer(cfg, layer_idx=0)
    copy_attention(ours.self_attn, theirs.self_attn)
    copy_mlp(ours.mlp, theirs.mlp)
    with torch.no_grad():
        for a, b in [(ours.input_layernorm, theirs.input_layernorm),
                     (ours.post_attention_layernorm, theirs.post_attention_layernorm)]:
            b.weight.uniform_(0.5, 1.5)
            a.weight.copy_(b.weight)
    T = 9
    x = torch.randn(T, cfg.hidden_size)
    positions = torch.arange(T)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(x[None], positions[None])
    with torch.no_grad():
        expected = theirs(x[None], attention_mask=hf_causal_mask(T), position_embeddings=(hf_cos, hf_sin))
        expected = expected[0] if isinstance(expected, tuple) else expected
        cos, sin = RotaryEmbedding(cfg)(positions, x.dtype)
        out, residual = ours(x, None, cos, sin, PrefillContext([T]))  # the first layer: x is the whole stream
        part = torch.randn_like(x)
        out2, residual2 = ours(x - part, part, cos, sin, PrefillContext([T]))  # a stream handed over in two parts
    torch.testing.assert_close(out + residual, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2 + residual2, expected[0], atol=1e-5, rtol=1e-5)
