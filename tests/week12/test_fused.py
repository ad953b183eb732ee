"""Week 12: the fused decode kernels equal the reference layers they replace.

Each kernel against the PyTorch code of nanoserve/layers.py, then the whole fused decode forward
pass against `Llama.forward` with a paged context. On the CPU they run in Triton's interpreter.
"""

import pytest
import torch

from nanoserve.cache import PagedContext, PagedKVCache
from nanoserve.layers import RMSNorm, apply_rope
from nanoserve.testing import make_checkpoint, tiny_config

pytest.importorskip("triton", reason="week 12's kernels need the triton package: pip install triton (Linux)")
from nanoserve.kernels.fused import add_rmsnorm, fused_decode_forward, rope_write_kv, silu_mul  # noqa: E402
from nanoserve.loader import load_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:  # the same rounding points; only the order of a float32 sum may differ
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm(dtype):
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 96, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5).to(DEVICE, dtype)
    norm.weight.data = torch.rand(96, generator=g).to(DEVICE, dtype) + 0.5
    expected_sum = x + res
    expected = norm(expected_sum)
    y, r = add_rmsnorm(x, res.clone(), norm.weight, 1e-5)
    close(y, expected, dtype)
    assert torch.equal(r, expected_sum)  # one rounded add, as the reference's
    y0, r0 = add_rmsnorm(x, None, norm.weight, 1e-5)  # the first layer: no residual yet
    close(y0, norm(x), dtype)
    assert r0 is x


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(dtype):
    Hq, Hkv, D, T, block = 4, 2, 16, 3, 4
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(DEVICE, dtype)
    angles = torch.rand(T, D // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEVICE, dtype)
    cache = PagedKVCache(1, 4, block, Hkv, D, dtype=dtype, device=DEVICE)
    slots = torch.tensor([5, 0, 14], device=DEVICE)
    q = rope_write_kv(qkv, cos, sin, cache.k[0], cache.v[0], slots, Hq, Hkv, D)
    q_ref, k_ref, v_ref = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    close(q, apply_rope(q_ref.view(T, Hq, D), cos, sin), dtype)
    k_pool, v_pool = cache.k[0].view(-1, Hkv, D), cache.v[0].view(-1, Hkv, D)
    close(k_pool[slots], apply_rope(k_ref.reshape(T, Hkv, D), cos, sin), dtype)
    assert torch.equal(v_pool[slots], v_ref.reshape(T, Hkv, D))
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)  # > one block
    gate, up = gate_up.split(1500, dim=-1)
    close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


def test_fused_decode_forward_matches_the_model(tmp_path):
    """A decode step for 3 sequences with different pasts: same hidden states and same K/V in the
    pool as the model's own forward pass over a paged context (float32)."""
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    cfg = model.config
    block = 4
    caches = [PagedKVCache(cfg.num_layers, 16, block, cfg.num_kv_heads, cfg.head_dim, device=DEVICE) for _ in range(2)]
    tables = [[3, 7], [1], [9, 2, 4]]
    pasts = [5, 2, 9]  # tokens already cached; this step adds one each
    g = torch.Generator().manual_seed(3)
    for cache in caches:  # the same random past in both pools
        torch.manual_seed(4)
        cache.k.normal_()
        cache.v.normal_()
    ids = torch.randint(0, cfg.vocab_size, (3,), generator=g).to(DEVICE)
    positions = torch.tensor(pasts, device=DEVICE)
    slots = torch.tensor([t[p // block] * block + p % block for t, p in zip(tables, pasts)], device=DEVICE)
    lens = [p + 1 for p in pasts]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    ctx = PagedContext(caches[0], slots, [0, 1, 2, 3], lens, bt)
    with torch.no_grad():
        expected = model(ids, positions, ctx)
        got = fused_decode_forward(model, ids, positions, caches[1], slots, bt.int(),
                                   torch.tensor(lens, dtype=torch.int32, device=DEVICE), 64, num_splits=2)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for new, ref in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):  # equal up to float32 rounding
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
    others = [s for s in range(16 * block) if s not in slots.tolist()]  # only the new slots were written
    for new, ref in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):
        assert torch.equal(new.flatten(1, 2)[:, others], ref.flatten(1, 2)[:, others])


@pytest.mark.gpu
def test_prefill_attention_runs_a_fused_kernel():
    """Prefill attention in bf16 must reach a fused SDPA kernel, not PyTorch's float32 "math"
    path, which it silently took with 3-D inputs (week 12, section 12); and still be right."""
    from torch.profiler import ProfilerActivity, profile

    from nanoserve.attention import causal_attention
    from nanoserve.kernels.triton_backend import _sdpa_causal

    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(300, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(300, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = _sdpa_causal(q, k, v)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_efficient_attention" in ops, sorted(ops)
    assert not any("math" in op for op in ops), sorted(ops)
    close(out, causal_attention(q, k, v), torch.bfloat16)
