"""Week 1: RMSNorm and rotary embeddings, each against HuggingFace's own implementation."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import RMSNorm, RotaryEmbedding, apply_rope, rope_inv_freq
from nanoserve.testing import LLAMA_3_2_1B, tiny_config


@pytest.mark.exercise("rmsnorm")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 2048)])
def test_rmsnorm_matches_hf(dtype, atol, shape):
    hidden = shape[-1]
    ours, theirs = RMSNorm(hidden, eps=1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    weight = torch.rand(hidden) + 0.5
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (torch.randn(shape) * 3).to(dtype)
    out = ours(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, theirs(x), atol=atol, rtol=0)


@pytest.mark.exercise("rmsnorm")
def test_rmsnorm_output_has_unit_rms():
    norm = RMSNorm(512, eps=1e-6)
    y = norm(torch.randn(10, 512) * 7 + 2)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(10), atol=1e-4, rtol=0)


def _hf_config(cfg: dict) -> LlamaConfig:
    return LlamaConfig(**cfg)


ROPE_CASES = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "tiny-llama3": tiny_config(),
    "no-scaling": tiny_config(rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    "head-dim-128": tiny_config(head_dim=128),
}


@pytest.mark.exercise("rope-inv-freq")
@pytest.mark.parametrize("case", ROPE_CASES)
def test_inv_freq_matches_hf(case):
    hf = LlamaRotaryEmbedding(_hf_config(ROPE_CASES[case]))
    ours = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"],
                                  **_hf_config(ROPE_CASES[case]).to_dict()})
    inv_freq = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert inv_freq.shape == (ours.head_dim // 2,)
    torch.testing.assert_close(inv_freq, hf.inv_freq, atol=0, rtol=0)


@pytest.mark.exercise("rope-inv-freq")
def test_llama3_scaling_changes_only_low_frequencies():
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"],
                                 **_hf_config(LLAMA_3_2_1B).to_dict()})
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(plain[:4], scaled[:4])  # fast channels untouched
    torch.testing.assert_close(scaled[-4:], plain[-4:] / 32)  # slow channels slowed 32x
    assert (scaled <= plain).all()


@pytest.mark.exercise("rope-cos-sin", "apply-rope")
@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_and_rotation_match_hf(case, dtype):
    hf_cfg = _hf_config(ROPE_CASES[case])
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **hf_cfg.to_dict()})
    positions = torch.tensor([0, 1, 2, 17, 255, 8191, 8192, 30000])
    x = torch.randn(1, len(positions), cfg.head_dim, dtype=dtype)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf_cfg)(x, positions[None])
    cos, sin = RotaryEmbedding(cfg)(positions, dtype)
    torch.testing.assert_close(cos, hf_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=0, rtol=0)

    q = torch.randn(len(positions), 4, cfg.head_dim, dtype=dtype)  # [T, heads, D]
    k = torch.randn(len(positions), 2, cfg.head_dim, dtype=dtype)
    # HF wants [batch, heads, T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.exercise("rope-cos-sin", "apply-rope")
def test_rope_is_relative():
    """The score between a rotated query and key depends only on their distance."""
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"],
                                 **_hf_config(tiny_config()).to_dict()})
    rope = RotaryEmbedding(cfg)
    q, k = torch.randn(1, 1, cfg.head_dim), torch.randn(1, 1, cfg.head_dim)

    def score(pq, pk):
        cq, sq = rope(torch.tensor([pq]), torch.float32)
        ck, sk = rope(torch.tensor([pk]), torch.float32)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(10, 3), score(107, 100), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(10, 3), score(10, 9), atol=1e-3)
