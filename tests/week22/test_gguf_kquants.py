"""Week 22 (issue 33): week 19's Q5_0, Q5_1 and k-quants (Q4_K, Q5_K, Q6_K) run as grouped codes
(nanoserve/model/gguf_quantized.py's `kquant_codes`), equal to week 19's dequantizers; the Triton
kernels over them; Gemma 3 270M's Q4_K_M file with every projection read as blocks."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.kernels.quant_matmul import quant_matmul
from nanoserve.model import gguf as gguf_file
from nanoserve.model import quant
from nanoserve.model.gguf_quantized import GROUPS, grouped_codes, kquant_codes, narrowest, stack_parts
from nanoserve.model.quantized import QuantizedLinear, dequantize, pack_codes

TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
CODE_BITS = {"Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}  # the file's bits a code
# where each format keeps its float16 numbers: byte offsets within a block (d, then m or dmin)
FLOAT16_AT = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(type_name: str, n_blocks: int, seed: int = 0, extreme: bool = False) -> np.ndarray:
    """n random blocks, bytes [n, bytes per block]: every code, 6-bit scale and min and int8 scale
    pattern is legal, so only the float16 numbers need care. `extreme`: drawn from every finite
    float16 bit pattern (subnormals, ±65504, −0), else small normal ones as real files hold."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, quant.FORMATS[type_name].nbytes), dtype=np.uint8)
    for at in FLOAT16_AT[type_name]:
        if extreme:
            bits = rng.integers(0, 1 << 16, size=n_blocks).astype(np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent (inf, nan) loses a bit
            raw[:, at:at + 2] = bits.view(np.uint8).reshape(n_blocks, 2)
        else:
            raw[:, at:at + 2] = rng.normal(0, 0.05, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def with_bytes(type_name: str, n_blocks: int, byte: int, floats=(1.5, -0.5)) -> np.ndarray:
    """Blocks whose every byte is `byte` (codes, scales and mins all 0, all at their largest, or
    alternating), but for the float16 numbers."""
    raw = np.full((n_blocks, quant.FORMATS[type_name].nbytes), byte, dtype=np.uint8)
    for at, value in zip(FLOAT16_AT[type_name], floats):
        raw[:, at:at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return raw


def widened(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the blocks through the grouped format, week 19's dequantizer) for one tensor's bytes."""
    raw = torch.from_numpy(raw.reshape(-1).copy())
    codes, scales, offsets = kquant_codes(raw, type_name, shape)
    bits, group = GROUPS[type_name]
    assert codes.shape == shape and scales.shape == offsets.shape == (shape[0], shape[1] // group)
    assert int(codes.min()) >= 0 and int(codes.max()) < (1 << CODE_BITS[type_name])
    ours = dequantize(pack_codes(codes, bits), narrowest(scales), narrowest(offsets), bits, group, torch.float32)
    return ours, quant.dequantize(raw, type_name, shape)


def assert_bit_for_bit(ours: torch.Tensor, theirs: torch.Tensor, type_name: str) -> None:
    """Equal numbers; the bits too, but where Q5_0's or Q6_K's dequantizer makes −0 of (c − centre) = 0
    times a negative scale, and q · s + o gives +0."""
    assert torch.equal(ours, theirs)
    differ = ours.view(torch.int32) != theirs.view(torch.int32)
    assert (theirs[differ] == 0).all()
    if type_name not in ("Q5_0", "Q6_K"):
        assert not differ.any()


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("extreme", [False, True])
def test_k_quant_blocks_as_codes_equal_week_19s_dequantizer(type_name, extreme):
    """codes · scale + offset in float32 (the reference path's widening, the kernels' arithmetic)
    gives week 19's numbers, from small scales to ±65504 and subnormals."""
    values = quant.FORMATS[type_name].values
    shape = (8, 64 * values // 8)  # 64 blocks in 8 rows
    ours, theirs = widened(type_name, random_blocks(type_name, 64, seed=len(type_name), extreme=extreme), shape)
    assert_bit_for_bit(ours, theirs, type_name)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("byte", [0x00, 0xFF, 0xAA, 0x55])
@pytest.mark.parametrize("floats", [(1.5, -0.5), (65504.0, -65504.0), (0.0, 0.0), (-2.0**-24, 2.0**-14)])
def test_extreme_codes_and_scales_equal_week_19s_dequantizer(type_name, byte, floats):
    """Every code and sub-block scale at 0, at its largest (0xFF: q = 15, 31 or 63, 6-bit scales and
    mins 63, Q6_K's int8 scales −1) or alternating, under the largest float16 numbers, zeros and
    the smallest subnormal: Q6_K's largest product, 65504 · 128 · 63, still has 24 significant bits."""
    values = quant.FORMATS[type_name].values
    ours, theirs = widened(type_name, with_bytes(type_name, 4, byte, floats), (2, 2 * values))
    assert_bit_for_bit(ours, theirs, type_name)


@pytest.mark.parametrize("type_name", TYPES)
def test_scales_are_float16_only_where_float16_holds_them(type_name):
    """A k-quant's scale d · sc needs up to 18 significant bits: float32. Q5_0 and Q5_1's d and m
    are the file's float16 numbers (and −16 d is exact) — unless −16 d overflows float16."""
    shape = (4, 4 * quant.FORMATS[type_name].values)
    raw = torch.from_numpy(random_blocks(type_name, 16, seed=3).reshape(-1).copy())
    _, scales, offsets = kquant_codes(raw, type_name, shape)
    small = torch.float16 if type_name in ("Q5_0", "Q5_1") else torch.float32
    assert narrowest(scales).dtype == narrowest(offsets).dtype == small
    if type_name == "Q5_0":
        raw = torch.from_numpy(with_bytes("Q5_0", 4, 0x55, (8192.0,)).reshape(-1).copy())
        _, scales, offsets = kquant_codes(raw, "Q5_0", (1, 128))
        assert narrowest(scales).dtype == torch.float16 and narrowest(offsets).dtype == torch.float32


def test_a_layer_stacked_from_parts_of_different_types():
    """Q6_K (8 bits, groups of 16, float32), Q4_K (4 bits, 32) and Q8_0 (8 bits, 32, float16) rows in
    one layer: 8-bit codes, groups of 16 (each group of 32 repeated), float32 scales; its weight is
    the parts' dequantized rows, stacked."""
    parts, expected = [], []
    for seed, type_name in enumerate(["Q6_K", "Q4_K", "Q8_0"]):
        values = quant.FORMATS[type_name].values
        n_blocks = 3 * 512 // values  # 3 rows of 512
        if type_name == "Q8_0":
            rng = np.random.default_rng(seed)
            raw = rng.integers(0, 256, size=(n_blocks, 34), dtype=np.uint8)
            raw[:, :2] = rng.normal(0, 0.05, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
        else:
            raw = random_blocks(type_name, n_blocks, seed=seed)
        raw = torch.from_numpy(raw.reshape(-1).copy())
        parts.append((type_name, *grouped_codes(raw, type_name, (3, 512))))
        expected.append(quant.dequantize(raw, type_name, (3, 512)))
    layer = stack_parts(parts)
    assert (layer.bits, layer.group_size, layer.scales.dtype) == (8, 16, torch.float32)
    assert (layer.out_features, layer.in_features) == (9, 512)
    assert torch.equal(layer.weight_dequantized(torch.float32), torch.cat(expected))
    # what is stored: a byte a code, a float32 scale and offset per 16 weights: 12 bits a weight
    assert layer.weight_bytes() * 8 == 9 * 512 * 12


def k_quant_layer(type_name: str, n: int, k: int, seed: int) -> QuantizedLinear:
    raw = random_blocks(type_name, n * k // quant.FORMATS[type_name].values, seed=seed)
    return stack_parts([(type_name, *kquant_codes(torch.from_numpy(raw.reshape(-1).copy()), type_name, (n, k)))])


@pytest.mark.exercise("quant-gemv")
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_the_kernels_over_k_quant_blocks_equal_widen_then_multiply(type_name, m):
    """Float32, through Triton's interpreter: layers made from each type's blocks (8-bit codes for 5
    and 6 bits, groups of 16 for Q6_K, float32 scales for the k-quants), the matrix-vector kernel up
    to 4 rows and the tiles above, equal widening the whole weight first and multiplying: only the
    order of the sums differs, so each output is within 1e-5 of the sum of its terms' magnitudes
    (random 6-bit sub-block scales make large terms that cancel)."""
    n, k = 40, 512  # ragged against the kernels' blocks of outputs; two super-blocks a row
    layer = k_quant_layer(type_name, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    weight = layer.weight_dequantized(torch.float32)
    got = quant_matmul(x, layer)
    assert got.shape == (m, n)
    terms = x.abs() @ weight.abs().t()  # [m, n]: the sum of |x_k · w_k| for each output
    assert ((got - x @ weight.t()).abs() <= 1e-5 * terms).all()


# ------------------------------------------------------------ Gemma 3 270M's Q4_K_M file

gemma3 = pytest.mark.skipif(importlib.util.find_spec(gguf_file.GEMMA3_270M_PACKAGE) is None,
                            reason=f"needs Gemma 3 270M's GGUF file: {gguf_file.GEMMA3_270M_INSTALL}")

# Gemma 3 270M's projections as stored, bits a weight: (module, bits, group) -> bits a weight
GEMMA_BITS = {
    ("qkv_proj", 8, 32): 9.0,  # q and k Q5_0, v Q5_0 or Q8_0: a byte a code, float16 scale and offset per 32
    ("gate_up_proj", 8, 32): 9.0,  # Q5_0
    ("o_proj", 4, 32): 6.0,  # Q4_K: two codes a byte, float32 scale and offset per 32
    ("down_proj", 4, 32): 6.0,  # Q4_K in 9 layers
    ("down_proj", 8, 16): 12.0,  # Q6_K in the other 9: a byte a code, float32 scale and offset per 16
}


@gemma3
@pytest.mark.slow
@pytest.mark.xdist_group("large-models")
@torch.no_grad()
def test_gemma3_270m_from_its_own_blocks_equals_the_widened_model():
    """Float32 on the CPU: every projection of Gemma 3 270M's Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K)
    held as the file's codes gives the logits of the model widened at load (week 19's path) bit for
    bit, and the same greedy tokens through the engine."""
    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    plain = LLM("gemma3-270m", device="cpu")
    quantized = LLM("gemma3-270m", device="cpu", quantization="gguf")
    model = quantized.engine.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 4 * model.config.num_layers  # q/k/v, o, gate/up and down of every layer
    for name, layer in layers.items():
        key = (name.rsplit(".", 1)[-1], layer.bits, layer.group_size)
        assert layer.weight_bytes() * 8 == GEMMA_BITS[key] * layer.in_features * layer.out_features, name

    ids = torch.tensor(plain.tokenizer.encode("The capital of France is Paris, and the capital of Italy is"))
    positions = torch.arange(len(ids))

    def logits(m):
        return m.compute_logits(m(ids, positions, PrefillContext([len(ids)])))
    assert torch.equal(logits(model), logits(plain.engine.model))

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [plain.tokenizer.encode(p) for p in ["The capital of France is", "def fibonacci(n):"]]
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in quantized.generate(prompts, params)] == expected
