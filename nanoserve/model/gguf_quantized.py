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

Other types (F16, and the k-quants for now) keep their layer dense; a fused layer whose parts
differ in type stays dense too.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from nanoserve.model.gguf import family_tensor_name, open_gguf, read_metadata, tensor_shape, unpermute_qk
from nanoserve.model.gguf_families import PERMUTED_QK
from nanoserve.model.loader import hf_to_nanoserve
from nanoserve.model.quant import FORMATS
from nanoserve.model.quantized import QuantizedLinear, pack_codes

GROUPED_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}  # the GGUF types read as they are, and their codes' bits
BLOCK = 32


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


def gguf_linear_layers(path: str | os.PathLike, config) -> dict[str, QuantizedLinear]:
    """{module name: QuantizedLinear} for every decoder projection of the file whose tensors are all
    Q8_0, Q4_0 or Q4_1 of one type (fused parts stacked in the order week 1's loader uses)."""
    import numpy as np

    # >>> week22: gguf-layers
    reader = open_gguf(path)
    arch = read_metadata(reader)["general.architecture"]
    parts: dict[str, dict[int, tuple[str, torch.Tensor, ...]]] = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") or not t.name.endswith(".weight"):
            continue
        name, shard = hf_to_nanoserve(family_tensor_name(arch, t.name))
        module = name.removesuffix(".weight")
        if not module.endswith("proj"):
            continue
        kind = t.tensor_type.name
        if kind not in GROUPED_BITS:
            parts.setdefault(module, {})[shard or 0] = (kind,)
            continue
        raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))
        codes, scales, offsets = block_codes(raw, kind, tensor_shape(t))
        if arch in PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if t.name.endswith("attn_q.weight") else config.num_kv_heads
            codes, scales, offsets = (unpermute_qk(x, heads) for x in (codes, scales, offsets))
        parts.setdefault(module, {})[shard or 0] = (kind, codes, scales, offsets)
    layers = {}
    for module, shards in parts.items():
        kinds = {p[0] for p in shards.values()}
        if len(kinds) != 1 or next(iter(kinds)) not in GROUPED_BITS:
            continue  # mixed or other types: the dense layer stays
        ordered = [shards[i] for i in sorted(shards)]
        bits = GROUPED_BITS[ordered[0][0]]
        codes, scales, offsets = (torch.cat([p[j] for p in ordered]) for j in (1, 2, 3))
        layers[module] = QuantizedLinear(pack_codes(codes, bits), scales, offsets, bits, BLOCK, codes.shape[1])
    return layers
    # <<< week22: gguf-layers


def use_gguf_blocks(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Swap the decoder projections of `model` (loaded from the file's week-13 conversion) for
    layers holding the file's own blocks; returns the names swapped. Biases (Qwen2's q/k/v) move
    over from the dense layer."""
    layers = gguf_linear_layers(path, model.config)
    if not layers:
        raise ValueError(f"{os.fspath(path)} has no decoder projection in Q8_0, Q4_0 or Q4_1 to run as it is: "
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
