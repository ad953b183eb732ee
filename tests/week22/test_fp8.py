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
