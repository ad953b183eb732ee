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
the low nibble. Scales and offsets [N, K / G] in float16, or in float32 where a GGUF file's numbers
need it (its k-quants' d · sc: nanoserve/model/gguf_quantized.py); both paths widen in float32.

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
GROUP_SIZES = (128, 64, 32)  # the default: the first that divides every projection's inputs


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
    # >>> week22: quantize-rtn
    n, k = weight.shape
    levels = (1 << bits) - 1
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / levels).clamp(min=1e-8).half()
    offsets = low.half()
    q = torch.round((groups - offsets.float()[..., None]) / scales.float()[..., None]).clamp(0, levels)
    return pack_codes(q.reshape(n, k), bits), scales, offsets
    # <<< week22: quantize-rtn


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


FP8_MAX = 448.0  # the largest finite float8 e4m3 number
KV_SCALE_FLOOR = 2.0**-14  # issue 33's FP8 KV cache: no float16 scale below its smallest normal number


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x -> (float8 e4m3 rows, float32 scales [rows, 1]) with x ≈ rows · scale: each row's
    largest magnitude lands on e4m3's largest number, 448."""
    # >>> week22: fp8-rows
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale
    # <<< week22: fp8-rows


class Fp8Linear(nn.Module):
    """y = x · Wᵀ (+ bias) on FP8 tensor cores (Ada, Hopper): W stored in float8 e4m3 with one
    float32 scale per output row, chosen at load; the activations cut to e4m3 per row at every call
    (their own scale per token), and `torch._scaled_mm` multiplies the two and applies both scales
    in its epilogue, returning bfloat16. Half the bytes of bf16 weights; unlike the integer layers,
    the activations are quantized too (the tensor cores take two FP8 operands)."""

    def __init__(self, weight_fp8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        self.register_buffer("weight_fp8", weight_fp8)
        self.register_buffer("scales", scales)  # float32 [out, 1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # On a GPU: nanoserve.kernels.quant_matmul.fp8_gemv, which for the few rows of a decode step
        # widens the e4m3 weights in registers against activations kept in their dtype (weight-only,
        # as the integer layers) and hands larger batches to `scaled_product`; None: `scaled_product`.
        self.kernel = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "a layer") -> Fp8Linear:
        for size in (linear.in_features, linear.out_features):
            if size % 16:
                raise ValueError(f"{name}: FP8 products need sizes divisible by 16, not {linear.in_features} x "
                                 f"{linear.out_features}")
        weight, scales = fp8_rows(linear.weight.data)
        return cls(weight, scales, None if linear.bias is None else linear.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.scaled_product(x) if self.kernel is None else self.kernel(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def scaled_product(self, x: torch.Tensor) -> torch.Tensor:
        """x · Wᵀ on FP8 tensor cores, the activations cut to e4m3 per row (no bias)."""
        shape = x.shape
        rows, x_scales = fp8_rows(x.reshape(-1, shape[-1]))
        y = torch._scaled_mm(rows, self.weight_fp8.t(), scale_a=x_scales, scale_b=self.scales.t(),
                             out_dtype=torch.bfloat16)
        return y.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """What a product reads for the weight: the e4m3 bytes and their float32 scales."""
        return self.weight_fp8.numel() + self.scales.numel() * 4


def default_group_size(in_features: list[int]) -> int:
    """The largest of `GROUP_SIZES` that divides every one of these input sizes (SmolLM2's 576
    inputs take 64; Llama's 2,048 and 8,192 take 128)."""
    for group in GROUP_SIZES:
        if all(k % group == 0 for k in in_features):
            return group
    raise ValueError(f"no group size of {GROUP_SIZES} divides every projection's inputs ({sorted(set(in_features))}): "
                     "give one with --quantization-group-size")


def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None) -> list[str]:
    """Swap every decoder layer's projection (q/k/v, o, gate/up, down) for a `QuantizedLinear` of
    `scheme` (int8, int4) or an `Fp8Linear` (fp8), in place; returns the names swapped. The embedding and the LM head stay in the model's
    dtype (they are looked up or produce the logits the sampler reads; quantizing them is a choice
    this lesson leaves out). Every group size is checked before anything is swapped."""
    if scheme not in SCHEMES and scheme != "fp8":
        raise ValueError(f"unknown --quantization {scheme!r}: choose one of {', '.join(SCHEMES)}, fp8")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and ".layers." in f".{name}" and name.rsplit(".", 1)[-1].endswith("proj")]
    if not targets:
        raise ValueError("this model has no decoder projections to quantize")
    if scheme == "fp8":
        swapped = {name: Fp8Linear.from_linear(m, name) for name, m in targets}  # every size checked first
    else:
        group_size = group_size or default_group_size([m.in_features for _, m in targets])
        for name, m in targets:
            check_group_size(m.in_features, group_size, SCHEMES[scheme], name)
        swapped = {name: QuantizedLinear.from_linear(m, SCHEMES[scheme], group_size, name) for name, m in targets}
    for name, layer in swapped.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, layer)
    return list(swapped)
