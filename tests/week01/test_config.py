"""Week 1: reading config.json."""

import json

import pytest

from nanoserve.model.config import ConfigError, ModelConfig, RopeScaling
from nanoserve.testing import make_checkpoint, tiny_config

pytestmark = pytest.mark.exercise("config-from-dict")

# Llama-3.2-1B's config.json as published (transformers 4.x format: rope_theta + rope_scaling).
LLAMA_32_1B_JSON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}


def test_llama_3_2_1b_config():
    cfg = ModelConfig.from_dict(LLAMA_32_1B_JSON)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (16, 2048, 8192)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 8, 64)
    assert cfg.vocab_size == 128256 and cfg.tie_word_embeddings
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_ids == (128001,) and cfg.bos_token_id == 128000
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.q_size == 2048 and cfg.kv_size == 512


def test_config_written_by_transformers(tmp_path):
    """transformers >= 5 writes `rope_parameters`; we read it the same way."""
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config(head_dim=24, hidden_size=64))
    cfg = ModelConfig.from_json(path)
    assert cfg.head_dim == 24  # head_dim given explicitly wins over hidden / heads
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_theta == 10000.0


def test_head_dim_defaults_to_hidden_over_heads():
    raw = dict(LLAMA_32_1B_JSON)
    del raw["head_dim"]
    assert ModelConfig.from_dict(raw).head_dim == 2048 // 32


def test_no_rope_scaling():
    raw = {k: v for k, v in LLAMA_32_1B_JSON.items() if k != "rope_scaling"}
    assert ModelConfig.from_dict(raw).rope_scaling is None


def test_untied_and_eos_list():
    raw = dict(LLAMA_32_1B_JSON, tie_word_embeddings=False, eos_token_id=[1, 2])
    cfg = ModelConfig.from_dict(raw)
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == (1, 2)


def test_unsupported_architecture_is_named():
    raw = dict(LLAMA_32_1B_JSON, architectures=["FalconForCausalLM"])
    with pytest.raises(ConfigError, match="FalconForCausalLM.*LlamaForCausalLM"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
              "num_hidden_layers", "rms_norm_eps", "max_position_embeddings", "rope_theta"],
)
def test_missing_field_is_named(field):
    raw = {k: v for k, v in LLAMA_32_1B_JSON.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


def test_unsupported_rope_type_is_named():
    raw = dict(LLAMA_32_1B_JSON, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_dict(raw)


def test_incomplete_llama3_scaling_is_named():
    scaling = {k: v for k, v in LLAMA_32_1B_JSON["rope_scaling"].items() if k != "low_freq_factor"}
    with pytest.raises(ConfigError, match="low_freq_factor"):
        ModelConfig.from_dict(dict(LLAMA_32_1B_JSON, rope_scaling=scaling))


def test_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ConfigError, match="multiple"):
        ModelConfig.from_dict(dict(LLAMA_32_1B_JSON, num_key_value_heads=5))


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_32_1B_JSON))
    assert ModelConfig.from_json(tmp_path).hidden_size == 2048
