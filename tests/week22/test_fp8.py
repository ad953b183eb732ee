"""Week 22 (issue 33): FP8 weights (`--quantization fp8`): e4m3 weights with per-row scales, activations cut
to e4m3 per token, `torch._scaled_mm`. The engine refuses it off FP8 tensor cores; the layer's
arithmetic is checked here on the CPU, where PyTorch's `_scaled_mm` runs too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanoserve.engine.config import EngineConfig
from nanoserve.model.loader import load_model
from nanoserve.model.quantized import FP8_MAX, Fp8Linear, fp8_rows, quantize_model


@pytest.mark.exercise("fp8-rows")
def test_each_row_lands_on_e4m3s_range_within_its_precision():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-3, 2, 8)[:, None]
    rows, scales = fp8_rows(x)
    assert rows.dtype == torch.float8_e4m3fn and scales.shape == (8, 1)
    assert torch.equal(rows.float().abs().amax(dim=1), torch.full((8,), FP8_MAX))
    back = rows.float() * scales
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value (normal numbers; the tiniest
    # values of a row fall to subnormals, bounded by the row's smallest step instead).
    bound = torch.maximum(x.abs() / 16, scales * 2.0 ** -9)
    assert ((back - x).abs() <= bound * 1.0001).all()


@pytest.mark.exercise("fp8-rows")
def test_the_layer_is_the_product_of_its_two_quantized_operands():
    """y = (x8 · sx) (W8 · sw)ᵀ, both scales applied once, returned in bfloat16."""
    torch.manual_seed(1)
    linear = nn.Linear(128, 48, bias=True)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)  # any leading shape
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)
    x8, sx = fp8_rows(x.reshape(-1, 128))
    expected = (x8.float() * sx) @ (layer.weight_fp8.float() * layer.scales).t() + linear.bias.data
    torch.testing.assert_close(y.reshape(-1, 48).float(), expected, rtol=1e-2, atol=1e-2)
    # and close to the unquantized product: a few percent, as two e4m3 roundings allow
    exact = x.float() @ linear.weight.data.t() + linear.bias.data
    assert (y.float() - exact).norm() / exact.norm() < 0.06
    assert layer.weight_bytes() == 48 * 128 + 48 * 4  # one byte a weight, a float32 scale a row


def test_a_model_with_fp8_projections_keeps_its_logits_close():
    model = load_model("tiny", dtype=torch.bfloat16)
    ids = torch.tensor([1, 5, 9, 13, 200, 7])
    positions = torch.arange(len(ids))
    from nanoserve.attention.base import PrefillContext

    before = model(ids, positions, PrefillContext([len(ids)])).float()
    names = quantize_model(model, "fp8")
    assert names and all(isinstance(model.get_submodule(n), Fp8Linear) for n in names)
    after = model(ids, positions, PrefillContext([len(ids)])).float()
    cosine = torch.nn.functional.cosine_similarity(before, after, dim=-1)
    assert (cosine > 0.98).all(), cosine


def test_fp8_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="on the CPU use int8 or int4"):
        EngineConfig(model="tiny", device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="sizes divisible by 16"):
        Fp8Linear.from_linear(nn.Linear(40, 48))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's FP8 refusals: run on a GPU")
def test_fp8_on_a_gpu_wants_bfloat16():
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        with pytest.raises(ValueError, match="needs FP8 tensor cores"):
            EngineConfig(model="tiny", device="cuda", quantization="fp8")
    else:
        with pytest.raises(ValueError, match="--dtype bfloat16"):
            EngineConfig(model="tiny", device="cuda", quantization="fp8", dtype=torch.float32)


def fp8_layer(n: int, k: int, bias: bool = False, seed: int = 0) -> Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    weight, scales = fp8_rows(torch.randn(n, k, generator=g))
    return Fp8Linear(weight, scales, torch.randn(n, generator=g) if bias else None)


@pytest.mark.exercise("fp8-rows", "quant-gemv")
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_a_decode_steps_rows_go_through_the_gemv_weight_only(rows):
    """Up to four rows (a decode step of a small batch) `fp8_gemv` widens the e4m3 bytes in
    registers and multiplies them by activations left as they are: x · (W8 · s)ᵀ, float32 to
    float32's rounding (ragged sizes: 42 outputs, 100 inputs)."""
    from nanoserve.kernels.quant_matmul import fp8_gemv

    layer = fp8_layer(42, 100)
    x = torch.randn(rows, 100, generator=torch.Generator().manual_seed(rows))
    expected = x @ (layer.weight_fp8.float() * layer.scales).t()
    torch.testing.assert_close(fp8_gemv(x, layer), expected, rtol=1e-5, atol=1e-5)
    # bfloat16 activations: each widened weight rounded to bfloat16 as the integer layers' are, the
    # sums in float32, rounded once at the end (within 2% of the largest output: the interpreter's
    # bfloat16 conversion does not round as the GPU's does)
    got = fp8_gemv(x.bfloat16(), layer)
    assert got.dtype == torch.bfloat16
    expected = x.bfloat16().float() @ (layer.weight_fp8.float() * layer.scales).t()
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.exercise("fp8-rows", "quant-gemv")
def test_larger_batches_and_the_bias_through_the_layers_kernel():
    """`use_quantized_kernels` hands `fp8_gemv` to every `Fp8Linear`: five rows and more go to
    `_scaled_mm` (the activations cut per token) exactly as without it, and the bias is added once
    on either path."""
    from nanoserve.kernels.quant_matmul import fp8_gemv, use_quantized_kernels

    layer = fp8_layer(48, 64, bias=True, seed=3)
    model = nn.Sequential(layer)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)  # 6 rows
    plain = layer(x)
    assert use_quantized_kernels(model) == 1 and layer.kernel is fp8_gemv
    assert torch.equal(layer(x), plain)
    one = x[:1, :1]
    torch.testing.assert_close(layer(one).float(), (fp8_gemv(one, layer) + layer.bias.bfloat16()).float())
    use_quantized_kernels(model, on=False)
    assert layer.kernel is None


@pytest.mark.gpu
def test_on_a_gpu_the_fp8_gemv_runs_compiled_in_a_cuda_graph():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 (compute capability 8.9 or more): run on an H100")
    from nanoserve.kernels.quant_matmul import fp8_gemv

    layer = fp8_layer(3072, 2048, seed=5).cuda()
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    out = fp8_gemv(x, layer)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, layer)
    for seed in range(3):
        x.copy_(torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        # the kernel rounds each widened weight to bf16 (as the CPU test's reference explains), so the
        # reference does too; then only the order of the float32 sums and the output's rounding differ
        widened = (layer.weight_fp8.float() * layer.scales).bfloat16().float()
        expected = x.float() @ widened.t()
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
