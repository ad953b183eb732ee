"""Week 13: block quantization, the way GGUF files store weights in 8 or 4 bits.

A quantized tensor is cut, row by row, into blocks of 32 consecutive values. Each block is stored
as a few bytes of scale (and minimum) in float16, followed by the 32 values as small integers:

    Q8_0   [d: f16][q: 32 x int8]                 34 bytes   x = d * q                    8.5 bits/weight
    Q4_0   [d: f16][q: 16 bytes, two 4-bit q's]   18 bytes   x = d * (q - 8)              4.5 bits/weight
    Q4_1   [d: f16][m: f16][q: 16 bytes]          20 bytes   x = d * q + m                5.0 bits/weight

In the 4-bit formats byte j of a block holds value j in its low nibble and value j + 16 in its
high nibble. Unquantized tensors (F32, F16, BF16) are plain little-endian arrays.

`dequantize` turns the raw bytes of a tensor back into float32; `quantize_q8_0` and
`quantize_q4_0` go the other way (the week's notebook uses them to measure what 4 and 8 bits
cost). Everything here is PyTorch on the CPU: a tensor of bytes in, a tensor of floats out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32  # values per block in every block format here


class UnsupportedQuantization(ValueError):
    """A tensor type nanoserve cannot dequantize (e.g. the k-quants, Q4_K and friends)."""


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
}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 2] -> float32 [n, 1]: a little-endian float16 per row."""
    return raw.contiguous().view(torch.float16).float()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values 0..15: the low nibbles are values 0-15, the high ones 16-31."""
    # >>> week13: unpack-nibbles
    low = qs & 0x0F
    high = qs >> 4
    return torch.cat([low, high], dim=1)
    # <<< week13: unpack-nibbles


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 34] uint8 blocks -> [n, 32] float32."""
    # >>> week13: dequantize-q8-0
    d = _f16(blocks[:, :2])  # [n, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return d * q
    # <<< week13: dequantize-q8-0


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 18] uint8 blocks -> [n, 32] float32."""
    d = _f16(blocks[:, :2])  # [n, 1]
    q = unpack_nibbles(blocks[:, 2:]).float() - 8  # [n, 32], in -8..7
    return d * q


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 20] uint8 blocks -> [n, 32] float32."""
    # >>> week13: dequantize-q4-1
    d = _f16(blocks[:, 0:2])  # [n, 1] scale
    m = _f16(blocks[:, 2:4])  # [n, 1] minimum
    q = unpack_nibbles(blocks[:, 4:]).float()  # [n, 32], in 0..15
    return d * q + m
    # <<< week13: dequantize-q4-1


_BLOCK_DEQUANTIZERS = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def check_supported(type_name: str, tensor_name: str = "a tensor") -> BlockFormat:
    if type_name not in FORMATS:
        raise UnsupportedQuantization(
            f"{tensor_name} is stored as {type_name}, which nanoserve cannot dequantize; supported "
            f"types: {', '.join(FORMATS)} (convert the model to one of them, e.g. llama.cpp's "
            "llama-quantize ... Q8_0, or pick a Q8_0 / Q4_0 / Q4_1 file)"
        )
    return FORMATS[type_name]


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The raw bytes of one tensor (uint8, any shape) -> a float32 tensor of `shape`."""
    fmt = check_supported(type_name)
    numel = 1
    for n in shape:
        numel *= n
    raw = raw.reshape(-1)
    if raw.numel() != numel // fmt.values * fmt.nbytes or numel % fmt.values:
        raise ValueError(f"{raw.numel()} bytes cannot hold a {type_name} tensor of shape {tuple(shape)}")
    if type_name in _FLOAT_DTYPES:
        return raw.view(_FLOAT_DTYPES[type_name]).float().reshape(shape)
    blocks = raw.view(-1, fmt.nbytes)  # [numel / 32, bytes per block]
    return _BLOCK_DEQUANTIZERS[type_name](blocks).reshape(shape)


# ------------------------------------------------------------------------ and back: quantizers


def _blocks_of(x: torch.Tensor) -> torch.Tensor:
    if x.numel() % BLOCK_SIZE:
        raise ValueError(f"{x.numel()} values do not split into blocks of {BLOCK_SIZE}")
    return x.detach().float().reshape(-1, BLOCK_SIZE)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> uint8 [n, 2]."""
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """float values (a multiple of 32) -> Q8_0 bytes [n_blocks * 34].

    The scale maps the block's largest magnitude to 127; every value rounds to the nearest step.
    """
    blocks = _blocks_of(x)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127  # [n, 1]
    d16 = d.to(torch.float16).float()  # the scale as it will be stored
    inv = torch.where(d16 > 0, 1 / d16, torch.zeros_like(d16))
    q = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8)
    return torch.cat([_f16_bytes(d16), q.view(torch.uint8)], dim=1).reshape(-1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """float values (a multiple of 32) -> Q4_0 bytes [n_blocks * 18].

    Sixteen steps -8..7 around zero: the value of largest magnitude (with its sign) becomes -8,
    so it is represented exactly and the other side gets the 7 remaining steps.
    """
    blocks = _blocks_of(x)
    idx = blocks.abs().argmax(dim=1, keepdim=True)
    extreme = blocks.gather(1, idx)  # [n, 1], signed
    d16 = (extreme / -8).to(torch.float16).float()
    inv = torch.where(d16 != 0, 1 / d16, torch.zeros_like(d16))
    q = (torch.round(blocks * inv) + 8).clamp(0, 15).to(torch.uint8)  # [n, 32]
    packed = q[:, :16] | (q[:, 16:] << 4)  # [n, 16]
    return torch.cat([_f16_bytes(d16), packed], dim=1).reshape(-1)
