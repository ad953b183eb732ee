"""Week 13: block quantization, the way GGUF files store weights in 8 or 4 bits.

A quantized tensor is cut, row by row, into blocks of 32 consecutive values. Each block is stored
as a few bytes of scale (and minimum) in float16, followed by the 32 values as small integers:

    Q8_0   [d: f16][q: 32 x int8]                 34 bytes   x = d * q                    8.5 bits/weight
    Q4_0   [d: f16][q: 16 bytes, two 4-bit q's]   18 bytes   x = d * (q - 8)              4.5 bits/weight
    Q4_1   [d: f16][m: f16][q: 16 bytes]          20 bytes   x = d * q + m                5.0 bits/weight

In the 4-bit formats byte j of a block holds value j in its low nibble and value j + 16 in its
high nibble. Unquantized tensors (F32, F16, BF16) are plain little-endian arrays.

`dequantize` turns the raw bytes of a tensor back into float32; `quantize` goes the other way
(the week's notebook uses it to measure what 4, 5 and 8 bits cost). Everything here is PyTorch on the CPU: a tensor of bytes in, a tensor of floats out.

Week 19 reads the rest of what a typical "Q4_K_M" file holds (llama.cpp mixes types within one
file, so one missing type refuses the whole model):

    Q5_0   [d][qh: 4 bytes][q: 16 bytes]          22 bytes   x = d * (q - 16)             5.5 bits/weight
    Q5_1   [d][m][qh: 4 bytes][q: 16 bytes]       24 bytes   x = d * q + m                6.0 bits/weight
    Q4_K   super-block of 256: 8 x 32, 4 bits    144 bytes   x = d*sc * q - dmin*m        4.5 bits/weight
    Q5_K   super-block of 256: 8 x 32, 5 bits    176 bytes   x = d*sc * q - dmin*m        5.5 bits/weight
    Q6_K   super-block of 256: 16 x 16, 6 bits   210 bytes   x = d*sc * (q - 32)          6.5625 bits/weight

The k-quants quantize twice: the values of each small sub-block in 4 to 6 bits against a
sub-block scale, and the sub-block scales themselves in 6 or 8 bits against one float16 scale per
super-block of 256 values. Each format's function below describes its bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK_SIZE = 32  # values per block in Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1
QK_K = 256  # values per super-block in the k-quants (Q4_K, Q5_K, Q6_K)


class UnsupportedQuantization(ValueError):
    """A tensor type nanoserve cannot dequantize (e.g. Q2_K, Q3_K or the IQ types)."""


@dataclass(frozen=True)
class BlockFormat:
    values: int  # values per block (1 for the plain float formats)
    nbytes: int  # bytes per block

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.values


FORMATS = {
    "F32": BlockFormat(1, 4),
    "F16": BlockFormat(1, 2),
    "BF16": BlockFormat(1, 2),
    "Q8_0": BlockFormat(BLOCK_SIZE, 2 + BLOCK_SIZE),
    "Q4_0": BlockFormat(BLOCK_SIZE, 2 + BLOCK_SIZE // 2),
    "Q4_1": BlockFormat(BLOCK_SIZE, 4 + BLOCK_SIZE // 2),
    # week 19: d (and m) f16, the 32 fifth bits, then the low nibbles as in Q4_0 / Q4_1
    "Q5_0": BlockFormat(BLOCK_SIZE, 2 + 4 + BLOCK_SIZE // 2),
    "Q5_1": BlockFormat(BLOCK_SIZE, 4 + 4 + BLOCK_SIZE // 2),
    # d and dmin f16, 12 bytes of packed 6-bit scales and mins, (the fifth bits,) the nibbles
    "Q4_K": BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 2),
    "Q5_K": BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    # low nibbles, high 2-bit pairs, 16 int8 scales, then d f16 (last, unlike the others)
    "Q6_K": BlockFormat(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 2] -> float32 [n, 1]: a little-endian float16 per row."""
    return raw.contiguous().view(torch.float16).float()


_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def check_supported(type_name: str, tensor_name: str = "a tensor") -> BlockFormat:
    if type_name not in FORMATS:
        raise UnsupportedQuantization(
            f"{tensor_name} is stored as {type_name}, which nanoserve cannot dequantize; supported "
            f"types: {', '.join(FORMATS)} (convert the model to one of them, e.g. llama.cpp's "
            "llama-quantize ... Q8_0, or pick a Q8_0 / Q4_0 / Q4_K_M file)"
        )
    return FORMATS[type_name]


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The raw bytes of one tensor (uint8, any shape) -> a float32 tensor of `shape`."""
    if type_name in BLOCK_DEQUANTIZERS:  # week 19's types: one function each, below
        return BLOCK_DEQUANTIZERS[type_name](_blocks(raw, type_name, shape)).reshape(shape)
    # >>> week13: dequantize
    fmt = check_supported(type_name)
    numel = math.prod(shape)
    raw = raw.reshape(-1)
    # A file whose byte counts do not add up is refused here, before a view misreads it.
    if numel % fmt.values or raw.numel() != numel // fmt.values * fmt.nbytes:
        raise ValueError(f"{raw.numel()} bytes cannot hold a {type_name} tensor of shape {tuple(shape)}")
    if type_name in _FLOAT_DTYPES:  # plain little-endian arrays: read the bytes as that type
        return raw.view(_FLOAT_DTYPES[type_name]).float().reshape(shape)
    blocks = raw.view(-1, fmt.nbytes)  # [n, bytes per block]
    d = _f16(blocks[:, :2])  # [n, 1]: every block format starts with its scale
    if type_name == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]: the same bytes, as signed
        return (d * q).reshape(shape)
    # The 4-bit formats end with 16 bytes of codes: value j in the low nibble of byte j, value
    # j + 16 in its high nibble (llama.cpp's order, so that a kernel splits a register in two).
    packed = blocks[:, -16:]  # [n, 16]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()  # [n, 32], 0..15
    if type_name == "Q4_0":
        return (d * (q - 8)).reshape(shape)
    m = _f16(blocks[:, 2:4])  # [n, 1]: Q4_1's minimum
    return (d * q + m).reshape(shape)
    # <<< week13: dequantize


# ------------------------------------------------ week 19: the 5-bit formats and the k-quants


def _blocks(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The raw bytes of a tensor -> its blocks, uint8 [n_blocks, bytes per block], after checking
    that the type is known and that the byte count fits the shape."""
    fmt = check_supported(type_name)
    numel = math.prod(shape)
    raw = raw.reshape(-1)
    if numel % fmt.values or raw.numel() != numel // fmt.values * fmt.nbytes:
        raise ValueError(f"{raw.numel()} bytes cannot hold a {type_name} tensor of shape {tuple(shape)}")
    return raw.view(-1, fmt.nbytes)


def _five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's codes: qh [n, 4] and qs [n, 16] bytes -> float32 [n, 32], 0..31.

    The low four bits of value j sit where Q4_0 keeps them: the low nibble of qs byte j for j < 16,
    the high nibble of qs byte j - 16 otherwise. The fifth bit of value j is bit j of qh, read as
    one little-endian 32-bit number: bit j % 8 of qh byte j // 8 (the first byte's bits 0..7 are
    values 0..7, the second byte's values 8..15, and so on).
    """
    low = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [n, 32], 0..15
    bit = torch.arange(8, dtype=torch.uint8)
    fifth = (qh.unsqueeze(2) >> bit) & 1  # [n, 4, 8]: byte b, bit k -> value 8 b + k
    return (low | (fifth.reshape(-1, 32) << 4)).float()


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks, uint8 [n, 22] -> float32 [n, 32].

    A block: [d: f16][qh: 4 bytes][qs: 16 bytes]. Each value has a 5-bit code q, 0..31, centred
    like Q4_0's: x = d * (q - 16), so the codes reach from -16 d to 15 d.
    """
    d = _f16(blocks[:, 0:2])  # [n, 1]
    q = _five_bit_codes(blocks[:, 2:6], blocks[:, 6:22])  # [n, 32]
    return d * (q - 16)


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 blocks, uint8 [n, 24] -> float32 [n, 32].

    A block: [d: f16][m: f16][qh: 4 bytes][qs: 16 bytes]. Like Q4_1 with one more bit:
    x = d * q + m, q = 0..31, so the codes reach from the block's minimum m to m + 31 d.
    """
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1] each
    q = _five_bit_codes(blocks[:, 4:8], blocks[:, 8:24])  # [n, 32]
    return d * q + m


def k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of sub-block scales -> (scales, mins), float32 [n, 8] each, 0..63.

    Eight 6-bit scales and eight 6-bit mins make 96 bits, packed in three groups of four bytes,
    a, b and c (bytes 0-3, 4-7 and 8-11):
        sub-blocks 0..3: scale i = low 6 bits of a[i],   min i = low 6 bits of b[i]
        sub-blocks 4..7: scale 4+i = low 4 bits of c[i] | top 2 bits of a[i] as bits 4-5
                         min   4+i = high 4 bits of c[i] | top 2 bits of b[i] as bits 4-5
    The top two bits of a and b are free because sub-blocks 0..3 use only six of their eight.
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # [n, 4] each
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=1)  # [n, 8]
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=1)  # [n, 8]
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 bytes of low nibbles -> uint8 [n, 8, 32]: sub-block, position, 0..15.

    The bytes go in four runs of 32: run r holds sub-block 2r in its low nibbles and sub-block
    2r + 1 in its high nibbles (byte 32 r + l: value l of both).
    """
    runs = qs.reshape(-1, 4, 32)  # [n, run, position]
    return torch.stack([runs & 0x0F, runs >> 4], dim=2).reshape(-1, 8, 32)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks, uint8 [n, 144] -> float32 [n, 256].

    A super-block of 256 values is 8 sub-blocks of 32, each with its own 6-bit scale sc and 6-bit
    min m (0..63), themselves scaled by the super-block's two float16 numbers d and dmin:

        [d: f16][dmin: f16][scales and mins: 12 bytes][qs: 128 bytes of 4-bit codes]

    Value l of sub-block i: x = (d * sc_i) * q - (dmin * m_i), q = 0..15. (Subtracted: the min
    is stored as a positive offset below zero.) The 12 bytes: `k_scales_and_mins`; the order of
    the codes: `_k_nibbles`.
    """
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1] each
    sc, m = k_scales_and_mins(blocks[:, 4:16])  # [n, 8] each
    q = _k_nibbles(blocks[:, 16:144]).float()  # [n, 8, 32]
    scale = (d * sc).unsqueeze(2)  # [n, 8, 1]: one scale per sub-block
    offset = (dmin * m).unsqueeze(2)  # [n, 8, 1]
    return (scale * q - offset).reshape(-1, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K super-blocks, uint8 [n, 176] -> float32 [n, 256].

    Q4_K with a fifth bit per value, stored between the scales and the nibbles:

        [d: f16][dmin: f16][scales and mins: 12 bytes][qh: 32 bytes][qs: 128 bytes]

    The fifth bit of value l of sub-block i is bit i of qh byte l (each qh byte serves the same
    position in all eight sub-blocks). x = (d * sc_i) * q - (dmin * m_i), q = 0..31.
    """
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1] each
    sc, m = k_scales_and_mins(blocks[:, 4:16])  # [n, 8] each
    qh = blocks[:, 16:48]  # [n, 32]
    low = _k_nibbles(blocks[:, 48:176])  # [n, 8, 32]
    bit = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)  # sub-block i reads bit i
    fifth = (qh.unsqueeze(1) >> bit) & 1  # [n, 8, 32]
    q = (low | (fifth << 4)).float()  # [n, 8, 32], 0..31
    scale = (d * sc).unsqueeze(2)  # [n, 8, 1]
    offset = (dmin * m).unsqueeze(2)  # [n, 8, 1]
    return (scale * q - offset).reshape(-1, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks, uint8 [n, 210] -> float32 [n, 256].

    A super-block of 256 values is 16 sub-blocks of 16, each with a signed 8-bit scale sc
    (-128..127) times the super-block's float16 d; no min. Codes have 6 bits, centred:
    x = (d * sc_i) * (q - 32), q = 0..63. The bytes:

        [ql: 128 bytes, low 4 bits][qh: 64 bytes, high 2 bits][scales: 16 x int8][d: f16]

    The 256 values are two halves of 128, each with its own 64 bytes of ql and 32 of qh. Within a
    half, value v (0..127):
        low 4 bits:  v < 64: low nibble of ql byte v;  v >= 64: high nibble of ql byte v - 64
        high 2 bits: v = 32 k + l (k = 0..3, l = 0..31): bits 2k and 2k+1 of qh byte l
    and sub-block i is values 16 i .. 16 i + 15 of the 256.
    """
    # >>> week19: dequantize-q6-k
    ql = blocks[:, 0:128].reshape(-1, 2, 64)  # [n, half, byte]
    qh = blocks[:, 128:192].reshape(-1, 2, 32)  # [n, half, byte]
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _f16(blocks[:, 208:210])  # [n, 1]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [n, 2, 128]
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((qh.unsqueeze(2) >> shift) & 0x03).reshape(-1, 2, 128)  # [n, 2, 128]: [k, l] -> 32 k + l
    q = (low | (high << 4)).float().reshape(-1, 16, 16)  # [n, sub-block, position], 0..63
    scale = (d * sc).unsqueeze(2)  # [n, 16, 1]
    return (scale * (q - 32)).reshape(-1, QK_K)
    # <<< week19: dequantize-q6-k


# type name -> the function from its blocks, uint8 [n, bytes], to float32 [n, values]
BLOCK_DEQUANTIZERS = {
    "Q5_0": dequantize_q5_0,
    "Q5_1": dequantize_q5_1,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
}


# ------------------------------------------------------------------------ and back: quantizers


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> uint8 [n, 2]."""
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def quantize(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """float values (a multiple of 32) -> the bytes of a Q8_0, Q4_0 or Q4_1 tensor, [n_blocks * bytes per block].

    Q8_0: the scale maps the block's largest magnitude to 127; every value rounds to the nearest step.
    Q4_0: sixteen steps -8..7 around zero: the value of largest magnitude (with its sign) becomes -8,
          so it is represented exactly and the other side gets the 7 remaining steps.
    Q4_1: sixteen steps from the block's minimum to its maximum, rounded as llama.cpp's reference
          quantizer rounds them, so the bytes are the ones the `gguf` package writes.
    """
    # >>> week13: quantize
    if type_name not in ("Q8_0", "Q4_0", "Q4_1"):
        raise UnsupportedQuantization(f"nanoserve quantizes to Q8_0, Q4_0 or Q4_1, not {type_name}")
    if x.numel() % BLOCK_SIZE:
        raise ValueError(f"{x.numel()} values do not split into blocks of {BLOCK_SIZE}")
    blocks = x.detach().float().reshape(-1, BLOCK_SIZE)  # [n, 32]
    if type_name == "Q8_0":
        d = (blocks.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16).float()  # [n, 1], as stored
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))  # an all-zero block has scale 0
        q = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8)
        return torch.cat([_f16_bytes(d), q.view(torch.uint8)], dim=1).reshape(-1)
    if type_name == "Q4_0":
        extreme = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))  # [n, 1], signed
        d = (extreme / -8).to(torch.float16).float()
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (torch.round(blocks * inv) + 8).clamp(0, 15).to(torch.uint8)  # [n, 32], 0..15
        header = _f16_bytes(d)
    else:
        low = blocks.amin(dim=1, keepdim=True)  # [n, 1]
        d = (blocks.amax(dim=1, keepdim=True) - low) / 15
        # llama.cpp's rule, kept to the bit: codes from the float32 scale and minimum (only the
        # stored copies are float16), rounded half up: + 0.5, then truncated (the codes are >= 0).
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.trunc((blocks - low) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        header = torch.cat([_f16_bytes(d), _f16_bytes(low)], dim=1)
    packed = q[:, :16] | (q[:, 16:] << 4)  # [n, 16]: value j low, value j + 16 high
    return torch.cat([header, packed], dim=1).reshape(-1)
    # <<< week13: quantize
