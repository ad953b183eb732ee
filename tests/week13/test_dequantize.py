"""Week 13: nanoserve's own dequantizers against the `gguf` package's, on random blocks.

Random bytes are a fair test of a block format: every bit pattern of the quantized values is
legal, so the only care needed is a finite float16 scale (and minimum).
"""

import gguf
import numpy as np
import pytest
import torch

from nanoserve.model import quant

BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def random_blocks(type_name: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """n random blocks of a format, as bytes, with finite float16 scales in the header."""
    rng = np.random.default_rng(seed)
    nbytes = quant.FORMATS[type_name].nbytes
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    header = 4 if type_name == "Q4_1" else 2
    scales = rng.normal(0, 0.05, size=(n_blocks, header // 2)).astype(np.float16)
    raw[:, :header] = scales.view(np.uint8).reshape(n_blocks, header)
    return raw


@pytest.mark.exercise("unpack-nibbles", "dequantize-q8-0", "dequantize-q4-1")
@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_block_dequantizers_match_gguf(type_name):
    raw = random_blocks(type_name, 257)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])  # [257, 32]
    ours = quant.dequantize(torch.from_numpy(raw), type_name, (257, 32))
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_formats_match_gguf(type_name):
    x = torch.randn(6, 64)
    kind = gguf.GGMLQuantizationType[type_name]
    stored = gguf.quants.quantize(x.numpy(), kind) if type_name == "BF16" else \
        x.numpy().astype(np.float16 if type_name == "F16" else np.float32)
    expected = gguf.quants.dequantize(stored, kind) if type_name == "BF16" else stored.astype(np.float32)
    ours = quant.dequantize(torch.from_numpy(stored.view(np.uint8).copy()), type_name, (6, 64))
    assert torch.equal(ours, torch.from_numpy(expected))


@pytest.mark.exercise("unpack-nibbles")
def test_unpack_nibbles_order():
    # byte j holds value j in its low nibble and value j + 16 in its high one
    qs = torch.tensor([[0x21, 0x43] + [0xF0] * 14], dtype=torch.uint8)
    values = quant.unpack_nibbles(qs)
    assert values.shape == (1, 32)
    assert values[0, :2].tolist() == [1, 3] and values[0, 16:18].tolist() == [2, 4]
    assert values[0, 2:16].tolist() == [0] * 14 and values[0, 18:].tolist() == [15] * 14


@pytest.mark.exercise("dequantize-q4-1")
def test_a_worked_q4_1_block():
    d, m = 0.5, -1.0
    header = np.array([d, m], dtype=np.float16).view(np.uint8)
    qs = np.array([0x10 * (15 - j % 16) + (j % 16) for j in range(16)], dtype=np.uint8)
    block = torch.from_numpy(np.concatenate([header, qs])[None])
    values = quant.dequantize_q4_1(block)[0]
    assert values[:16].tolist() == [d * j + m for j in range(16)]  # low nibbles 0..15
    assert values[16:].tolist() == [d * (15 - j) + m for j in range(16)]  # high nibbles 15..0


@pytest.mark.exercise("unpack-nibbles", "dequantize-q8-0")
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_own_quantizers_round_trip_and_gguf_reads_them(type_name):
    x = torch.randn(64, 96) * torch.rand(64, 1)  # rows of different scales
    packed = quant.quantize_q8_0(x) if type_name == "Q8_0" else quant.quantize_q4_0(x)
    assert packed.numel() == x.numel() // 32 * quant.FORMATS[type_name].nbytes
    back = quant.dequantize(packed, type_name, tuple(x.shape))
    theirs = gguf.quants.dequantize(packed.numpy().reshape(64, -1), gguf.GGMLQuantizationType[type_name])
    assert torch.equal(back, torch.from_numpy(theirs))  # the same bytes mean the same to both
    # Each value is within half a step of its block's scale (one step for Q4_0's far side).
    blocks, err = x.reshape(-1, 32), (back - x).reshape(-1, 32).abs()
    step = blocks.abs().amax(dim=1, keepdim=True) / (127 if type_name == "Q8_0" else 8)
    assert (err <= step * (0.5 if type_name == "Q8_0" else 1.0) * 1.01 + 1e-6).all()


def test_bits_per_weight():
    assert quant.FORMATS["Q8_0"].bits_per_weight == 8.5
    assert quant.FORMATS["Q4_0"].bits_per_weight == 4.5
    assert quant.FORMATS["Q4_1"].bits_per_weight == 5.0


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(quant.UnsupportedQuantization, match="Q4_K.*supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        quant.dequantize(torch.zeros(144, dtype=torch.uint8), "Q4_K", (256,))


def test_wrong_byte_count_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        quant.dequantize(torch.zeros(33, dtype=torch.uint8), "Q8_0", (32,))
