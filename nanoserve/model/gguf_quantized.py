"""Issue 33: a GGUF file's own blocks in `QuantizedLinear` layers (`--quantization gguf`).

Week 13 widens every tensor of a GGUF file to float32 once, into a cached checkpoint: SmolLM2's
98 MB Q4_1 file becomes 516.5 MiB and runs unquantized. Its blocks already are grouped codes:

    Q8_0   x = d · c          c a signed byte   ->  q = c + 128,  s = d,  o = −128 d
    Q4_0   x = d · (c − 8)    c in 0..15        ->  q = c,        s = d,  o = −8 d
    Q4_1   x = d · c + m      c in 0..15        ->  q = c,        s = d,  o = m

with one block of 32 values per group (nanoserve/model/quantized.py's format, G = 32). So the
decoder's projections are rebuilt from the file's bytes: codes reordered (llama.cpp keeps value j
and j + 16 of a block in one byte; the kernel wants neighbours), rows un-permuted where llama.cpp
permuted q and k (`unpermute_qk`, applied to codes, scales and offsets alike: it only moves rows),
q/k/v and gate/up stacked into the fused layers. In float32, q · s + o is the very number week 13's
dequantizer computes (each product is exact, and Q4_1's d · c + m is the same expression), so the
model gives week 13's tokens bit for bit, from the file's 4.5 to 8.5 bits a weight.

Week 19's types fit the same format (`kquant_codes`), one group per block or sub-block:

    Q5_0   x = d · (c − 16)         c in 0..31   ->  q = c,  s = d,       o = −16 d          G = 32
    Q5_1   x = d · c + m            c in 0..31   ->  q = c,  s = d,       o = m              G = 32
    Q4_K   x = d·sc · c − dmin·mn   c in 0..15   ->  q = c,  s = d · sc,  o = −(dmin · mn)   G = 32
    Q5_K   the same                 c in 0..31
    Q6_K   x = d·sc · (c − 32)      c in 0..63   ->  q = c,  s = d · sc,  o = −32 s          G = 16

5- and 6-bit codes are stored one a byte (the kernels read 8 or 4 bits). A k-quant's scale d · sc
is a float16 times a 6- or 8-bit integer: up to 18 significant bits, which float32 holds and
float16 does not, so those layers keep float32 scales and offsets (`narrowest`). Every product
q · s is still exact in float32 (at most 11 + 7 + 6 = 24 bits), so q · s + o rounds once, to the
dequantizer's number; for Q5_0 and Q6_K, whose dequantizers multiply by (c − centre), a zero
comes out +0 where theirs may be −0, the one difference (a product or a sum cannot tell them apart).

A fused layer whose parts differ in type (Gemma 3's q and k in Q5_0 beside v in Q8_0) takes their
widest common format: 8-bit codes if any part has them, the smallest group (a group of 32 is two
of 16 with the same scale and offset), float32 numbers if any part needs them. Other types (F16,
F32) keep their layer dense, and so does a fused layer with a part in one of them.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from nanoserve.model.gguf import family_tensor_name, open_gguf, read_metadata, tensor_shape, unpermute_qk
from nanoserve.model.gguf_families import PERMUTED_QK
from nanoserve.model.loader import hf_to_nanoserve
from nanoserve.model.quant import FORMATS, dequantize, k_scales_and_mins
from nanoserve.model.quantized import QuantizedLinear, pack_codes

# the GGUF types read as they are: (bits of their stored codes, weights a group)
GROUPS = {"Q8_0": (8, 32), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32),
          "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}
BLOCK = 32
CENTRES = {"Q5_0": 16, "Q6_K": 32}  # the formats whose dequantizer subtracts a centre from the code


def block_codes(raw: torch.Tensor, type_name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """The bytes of one Q8_0 / Q4_0 / Q4_1 tensor [N, K] -> (codes int32 [N, K], scales and offsets
    float16 [N, K / 32]) with W = codes · scale + offset, group by group."""
    # >>> week22: block-codes
    fmt = FORMATS[type_name]
    n, k = shape
    blocks = raw.reshape(-1).view(-1, fmt.nbytes)  # [N · K / 32, bytes]
    if blocks.shape[0] * BLOCK != n * k:
        raise ValueError(f"{raw.numel()} bytes cannot hold a {type_name} tensor of shape {shape}")
    d = blocks[:, :2].contiguous().view(torch.float16)  # [blocks, 1]
    if type_name == "Q8_0":
        codes = blocks[:, 2:].contiguous().view(torch.int8).to(torch.int32) + 128
        offsets = d * -128
    else:
        nibbles = blocks[:, -16:]
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).to(torch.int32)  # value j, then j + 16
        offsets = d * -8 if type_name == "Q4_0" else blocks[:, 2:4].contiguous().view(torch.float16)
    groups = k // BLOCK
    return codes.reshape(n, k), d.reshape(n, groups), offsets.reshape(n, groups)
    # <<< week22: block-codes


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [n, 2] -> float32 [n, 1]: a little-endian float16 per row."""
    return raw.contiguous().view(torch.float16).float()


def _unit_blocks(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """A copy of the blocks with every scale 1 and every minimum 0: week 19's dequantizer widens it
    to the codes themselves (less the centre of Q5_0 and Q6_K), so where each bit of a code sits
    stays written once, in nanoserve/model/quant.py."""
    unit = blocks.clone()
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # float16 1.0 as its two bytes
    if type_name == "Q6_K":  # [ql: 128][qh: 64][16 int8 scales][d]
        unit[:, 192:208] = 1
        unit[:, 208:210] = one
        return unit
    unit[:, 0:2] = one  # d
    if type_name != "Q5_0":
        unit[:, 2:4] = 0  # Q5_1's m, the k-quants' dmin
    if type_name in ("Q4_K", "Q5_K"):  # 6-bit scales 1 (bytes 0-3 low bits, 8-11 low nibbles), mins 0
        unit[:, 4:16] = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    return unit


def kquant_codes(raw: torch.Tensor, type_name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """The bytes of one Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K tensor [N, K] -> (codes int32 [N, K],
    scales and offsets float32 [N, K / G]), G from `GROUPS`, with W = codes · scale + offset."""
    fmt = FORMATS[type_name]
    n, k = shape
    group = GROUPS[type_name][1]
    blocks = raw.reshape(-1).view(-1, fmt.nbytes)  # [blocks, bytes]; the dequantizer checks the count
    unit = _unit_blocks(blocks, type_name).reshape(-1)
    codes = dequantize(unit, type_name, shape).to(torch.int32) + CENTRES.get(type_name, 0)  # [N, K]
    if type_name in ("Q5_0", "Q5_1"):
        scales = _f16(blocks[:, 0:2])  # [blocks, 1]
        offsets = scales * -16 if type_name == "Q5_0" else _f16(blocks[:, 2:4])
    elif type_name in ("Q4_K", "Q5_K"):
        sc, mins = k_scales_and_mins(blocks[:, 4:16])  # [blocks, 8] each, 0..63
        scales = _f16(blocks[:, 0:2]) * sc
        offsets = -(_f16(blocks[:, 2:4]) * mins)  # the dequantizer subtracts dmin · mn
    else:
        scales = _f16(blocks[:, 208:210]) * blocks[:, 192:208].contiguous().view(torch.int8).float()  # [blocks, 16]
        offsets = scales * -32
    return codes, scales.reshape(n, k // group), offsets.reshape(n, k // group)


def grouped_codes(raw: torch.Tensor, type_name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Any type of `GROUPS` -> (codes int32 [N, K], scales, offsets [N, K / G])."""
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        return block_codes(raw, type_name, shape)
    return kquant_codes(raw, type_name, shape)


def narrowest(x: torch.Tensor) -> torch.Tensor:
    """x in float16 if float16 holds every number of it exactly, else in float32."""
    half = x.half()
    return half if torch.equal(half.float(), x.float()) else x.float()


def stack_parts(parts: list[tuple]) -> QuantizedLinear:
    """The parts of one layer, [(type, codes, scales, offsets)] in shard order, stacked by rows in
    their widest common format: the most bits, the smallest group, scales and offsets in float16
    where every one of them fits it."""
    bits = max(GROUPS[p[0]][0] for p in parts)
    group = min(GROUPS[p[0]][1] for p in parts)
    repeat = [GROUPS[p[0]][1] // group for p in parts]  # a group of 32 is two of 16 with its numbers
    codes = torch.cat([p[1] for p in parts])
    scales, offsets = (torch.cat([p[j].float().repeat_interleave(r, dim=1) for p, r in zip(parts, repeat)])
                       for j in (2, 3))
    return QuantizedLinear(pack_codes(codes, bits), narrowest(scales), narrowest(offsets), bits, group,
                           codes.shape[1])


def gguf_linear_layers(path: str | os.PathLike, config) -> dict[str, QuantizedLinear]:
    """{module name: QuantizedLinear} for every decoder projection of the file whose tensors are all
    of a type in `GROUPS` (fused parts stacked in the order week 1's loader uses)."""
    import numpy as np

    # >>> week22: gguf-layers
    reader = open_gguf(path)
    arch = read_metadata(reader)["general.architecture"]
    parts: dict[str, dict[int, tuple | None]] = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or not t.name.endswith(".weight"):
            continue
        name, shard = hf_to_nanoserve(family_tensor_name(arch, t.name))
        module = name.removesuffix(".weight")
        if not module.endswith("proj"):
            continue
        kind = t.tensor_type.name
        if kind not in GROUPS:
            parts.setdefault(module, {})[shard or 0] = None  # another type: the dense layer stays
            continue
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
        codes, scales, offsets = grouped_codes(raw, kind, tensor_shape(t))
        if arch in PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if t.name.endswith("attn_q.weight") else config.num_kv_heads
            codes, scales, offsets = (unpermute_qk(x, heads) for x in (codes, scales, offsets))
        parts.setdefault(module, {})[shard or 0] = (kind, codes, scales, offsets)
    return {module: stack_parts([shards[i] for i in sorted(shards)])
            for module, shards in parts.items() if None not in shards.values()}
    # <<< week22: gguf-layers


def use_gguf_blocks(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Swap the decoder projections of `model` (loaded from the file's week-13 conversion) for
    layers holding the file's own blocks; returns the names swapped. Biases (Qwen2's q/k/v) move
    over from the dense layer."""
    layers = gguf_linear_layers(path, model.config)
    if not layers:
        raise ValueError(f"{os.fspath(path)} has no decoder projection in {', '.join(GROUPS)} to run as it is: "
                         "drop --quantization gguf (its weights are then widened at load)")
    for name, layer in layers.items():
        dense = model.get_submodule(name)
        if (dense.out_features, dense.in_features) != (layer.out_features, layer.in_features):
            raise ValueError(f"{name}: the file's blocks make [{layer.out_features}, {layer.in_features}], the model "
                             f"has [{dense.out_features}, {dense.in_features}]")
        if dense.bias is not None:
            layer.bias = nn.Parameter(dense.bias.data, requires_grad=False)
        device = dense.weight.device
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer.to(device))
        del dense
    return sorted(layers)
