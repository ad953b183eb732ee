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


@pytest.mark.exercise("dequantize")
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


@pytest.mark.exercise("dequantize")
def test_the_nibble_order():
    # byte j holds value j in its low nibble and value j + 16 in its high one
    header = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1, so each value is q - 8
    qs = np.array([0x21, 0x43] + [0xF0] * 14, dtype=np.uint8)
    values = quant.dequantize(torch.from_numpy(np.concatenate([header, qs])), "Q4_0", (32,))
    assert values[:2].tolist() == [1 - 8, 3 - 8] and values[16:18].tolist() == [2 - 8, 4 - 8]
    assert values[2:16].tolist() == [-8] * 14 and values[18:].tolist() == [15 - 8] * 14


@pytest.mark.exercise("dequantize")
def test_a_worked_q4_1_block():
    d, m = 0.5, -1.0
    header = np.array([d, m], dtype=np.float16).view(np.uint8)
    qs = np.array([0x10 * (15 - j % 16) + (j % 16) for j in range(16)], dtype=np.uint8)
    block = torch.from_numpy(np.concatenate([header, qs]))
    values = quant.dequantize(block, "Q4_1", (1, 32))[0]
    assert values[:16].tolist() == [d * j + m for j in range(16)]  # low nibbles 0..15
    assert values[16:].tolist() == [d * (15 - j) + m for j in range(16)]  # high nibbles 15..0


@pytest.mark.exercise("dequantize")
def test_a_q8_0_block_reads_signed_quants():
    header = np.array([0.25], dtype=np.float16).view(np.uint8)
    qs = np.arange(-16, 16, dtype=np.int8).view(np.uint8)  # bytes 0xF0..0xFF, then 0x00..0x0F
    values = quant.dequantize(torch.from_numpy(np.concatenate([header, qs])), "Q8_0", (32,))
    assert values.tolist() == [0.25 * q for q in range(-16, 16)]


@pytest.mark.exercise("quantize")
@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_own_quantizers_round_trip_and_gguf_reads_them(type_name):
    x = torch.randn(64, 96) * torch.rand(64, 1)  # rows of different scales
    packed = quant.quantize(x, type_name)
    assert packed.dtype == torch.uint8 and packed.numel() == x.numel() // 32 * quant.FORMATS[type_name].nbytes
    back = quant.dequantize(packed, type_name, tuple(x.shape))
    theirs = gguf.quants.dequantize(packed.numpy().reshape(64, -1), gguf.GGMLQuantizationType[type_name])
    assert torch.equal(back, torch.from_numpy(theirs))  # the same bytes mean the same to both
    # Each value is within half a step of its block's scale (one step for Q4_0's far side; for
    # Q4_1, plus what storing the scale and the minimum in float16 moves).
    blocks, err = x.reshape(-1, 32), (back - x).reshape(-1, 32).abs()
    if type_name == "Q4_1":
        low, high = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
        bound = (high - low) / 15 * 0.51 + low.abs() * 1e-3
    else:
        step = blocks.abs().amax(dim=1, keepdim=True) / (127 if type_name == "Q8_0" else 8)
        bound = step * (0.5 if type_name == "Q8_0" else 1.0) * 1.01
    assert (err <= bound + 1e-6).all()


@pytest.mark.exercise("quantize")
@pytest.mark.parametrize("case", ["random", "wide", "constant", "zeros", "halfway"])
def test_q4_1_quantizer_writes_the_bytes_gguf_writes(case):
    """Byte for byte llama.cpp's reference rule (through the `gguf` package): the minimum, the
    scale, each code's rounding, and the nibble order."""
    x = {"random": torch.randn(40, 64) * torch.rand(40, 1),
         "wide": torch.randn(8, 32) * 300,
         "constant": torch.full((2, 32), -0.75),  # max = min: scale 0, every code 0
         "zeros": torch.zeros(1, 32),
         "halfway": torch.tensor([[0.25 * j for j in range(31)] + [7.5]]),  # d = 0.5: codes 0, 0.5, 1, ...
         }[case]
    ours = quant.quantize(x, "Q4_1")
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q4_1).reshape(-1)
    assert ours.tolist() == theirs.tolist()


@pytest.mark.exercise("quantize")
def test_a_worked_q4_1_quantization():
    x = torch.tensor([-1.0 + 0.25 * (j % 16) for j in range(32)])  # min -1, max 2.75: d = 3.75 / 15 = 0.25
    raw = quant.quantize(x, "Q4_1")
    assert raw.shape == (20,)
    assert raw[:4].view(torch.float16).tolist() == [0.25, -1.0]
    assert raw[4:].tolist() == [j + 16 * j for j in range(16)]  # values j and j + 16 both have code j
    assert torch.equal(quant.dequantize(raw, "Q4_1", (32,)), x)


def test_quantize_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="blocks of 32"):
        quant.quantize(torch.zeros(40), "Q8_0")
    with pytest.raises(quant.UnsupportedQuantization, match="Q4_K"):
        quant.quantize(torch.zeros(32), "Q4_K")


def test_bits_per_weight():
    assert quant.FORMATS["Q8_0"].bits_per_weight == 8.5
    assert quant.FORMATS["Q4_0"].bits_per_weight == 4.5
    assert quant.FORMATS["Q4_1"].bits_per_weight == 5.0


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(quant.UnsupportedQuantization, match="Q2_K.*supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        quant.dequantize(torch.zeros(84, dtype=torch.uint8), "Q2_K", (256,))  # one Q2_K super-block


def test_wrong_byte_count_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        quant.dequantize(torch.zeros(33, dtype=torch.uint8), "Q8_0", (32,))
