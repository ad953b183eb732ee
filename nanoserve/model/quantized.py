"""Weight-only quantized linear layers (issue 33, first part): int8 and int4 weights in groups.

At batch 1 a decode step reads every weight once, so its time is the weights' bytes over the
memory bandwidth; fewer bits a weight is the one way under bf16's roofline. The activations stay
in the model's dtype ("W8A16", "W4A16"): only the weights are stored small and widened on the fly.

The format, one for every scheme here. A weight W [N, K] (N outputs, K inputs) is cut along K
into groups of G consecutive inputs; each row's group has a scale s and an offset o (float16),
and each weight an unsigned code q of `bits` bits:

    W[n, k] ≈ q[n, k] · s[n, k // G] + o[n, k // G]        q in [0, 2^bits)

- round to nearest, asymmetric (`quantize_rtn`): o = the group's minimum, s = (max − min) / (2^bits − 1),
  q = round((w − o) / s). GGUF's Q4_1 is exactly this with G = 32 (its `d` and `m`).
- symmetric formats fit too: Q8_0 (w = d · c, c a signed byte) is q = c + 128, s = d, o = −128 d;
  Q4_0 (w = d · (c − 8)) is q = c, s = d, o = −8 d.

Storage: 8-bit codes one per byte, [N, K]; 4-bit codes two per byte, [N, K / 2], the even input in
the low nibble. Scales and offsets [N, K / G] in float16.

`QuantizedLinear` keeps `nn.Linear`'s call (x [T, K] -> [T, N]); its PyTorch path widens the whole
weight and multiplies (the reference, and the CPU's path); on a GPU `kernel` holds the Triton
product of `nanoserve/kernels/quant_matmul.py`, which widens one tile at a time in registers
and never writes a float copy. `quantize_model` swaps the layers in after loading, as tensor
parallelism swaps its own: the model code does not change.
"""

from __future__ import annotations

import torch
from torch import nn

SCHEMES = {"int8": 8, "int4": 4}  # --quantization: the bits a weight, rounded to nearest at load
DEFAULT_GROUP_SIZE = 128


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] (integers in [0, 2^bits)) -> the stored bytes: [N, K] for 8 bits, [N, K / 2] for 4."""
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored bytes -> codes [N, K] as int32."""
    if bits == 8:
        return packed.to(torch.int32)
    low, high = (packed & 0xF).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`: q · s + o, each group's scale and offset repeated over its G inputs
    (computed in float32, rounded once)."""
    n, groups = scales.shape
    q = unpack_codes(packed, bits).float().view(n, groups, group_size)
    return (q * scales.float()[..., None] + offsets.float()[..., None]).view(n, groups * group_size).to(dtype)


def check_group_size(in_features: int, group_size: int, bits: int, name: str = "a layer") -> None:
    """Refuse a group size that does not cut the layer's inputs into whole groups."""
    if group_size < 2 or in_features % group_size:
        raise ValueError(f"--quantization-group-size {group_size} does not divide {name}'s {in_features} inputs: "
                         f"pick a divisor of every layer's input size (e.g. 32, 64 or 128)")
    if bits == 4 and group_size % 2:
        raise ValueError(f"4-bit codes are stored two per byte: the group size must be even, not {group_size}")


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest, asymmetric, per group: W [N, K] -> (packed codes, scales, offsets).

    Every group's range [min, max] is cut into 2^bits − 1 equal steps; a weight goes to the nearest
    step. The scale and the offset are rounded to float16 *before* the codes are chosen, so that the
    codes are the nearest under the scale that will really be used."""
    n, k = weight.shape
    levels = (1 << bits) - 1
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / levels).clamp(min=1e-8).half()
    offsets = low.half()
    q = torch.round((groups - offsets.float()[..., None]) / scales.float()[..., None]).clamp(0, levels)
    return pack_codes(q.reshape(n, k), bits), scales, offsets


class QuantizedLinear(nn.Module):
    """y = x · Wᵀ (+ bias) with W stored as grouped codes (the module's docstring)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                 group_size: int, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.bits, self.group_size = bits, group_size
        self.in_features, self.out_features = in_features, packed.shape[0]
        # Buffers, not parameters: nothing here is trained, and `.to(device)` still moves them.
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kernel = None  # on a GPU: nanoserve.kernels.quant_matmul.quant_matmul, or None for the code below

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, name: str = "a layer") -> QuantizedLinear:
        check_group_size(linear.in_features, group_size, bits, name)
        packed, scales, offsets = quantize_rtn(linear.weight.data, bits, group_size)
        bias = None if linear.bias is None else linear.bias.data
        return cls(packed, scales, offsets, bits, group_size, linear.in_features, bias)

    def weight_dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.packed, self.scales, self.offsets, self.bits, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x, self)
        else:
            y = x @ self.weight_dequantized(x.dtype).t()
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.offsets))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}")


def quantize_model(model: nn.Module, scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> list[str]:
    """Swap every decoder layer's projection (q/k/v, o, gate/up, down) for a `QuantizedLinear` of
    `scheme`, in place; returns the names swapped. The embedding and the LM head stay in the model's
    dtype (they are looked up or produce the logits the sampler reads; quantizing them is a choice
    this lesson leaves out). Every group size is checked before anything is swapped."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown --quantization {scheme!r}: choose one of {', '.join(SCHEMES)}")
    bits = SCHEMES[scheme]
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and ".layers." in f".{name}" and name.rsplit(".", 1)[-1].endswith("proj")]
    if not targets:
        raise ValueError("this model has no decoder projections to quantize")
    for name, m in targets:
        check_group_size(m.in_features, group_size, bits, name)
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, QuantizedLinear.from_linear(m, bits, group_size, name))
    return [name for name, _ in targets]
