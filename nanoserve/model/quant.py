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
"""

from __future__ import annotations

import math
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
