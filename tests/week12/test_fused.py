"""Week 12: the fused kernels equal the reference layers they replace.

Each kernel against the PyTorch code of nanoserve/model/layers.py, then `Llama.forward` with the
kernels swapped in against the same forward pass without them. On the CPU they run in Triton's
interpreter.
"""

import pytest
import torch

from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext, PagedKVCache
from nanoserve.model.layers import RMSNorm, apply_rope
from nanoserve.testing import make_checkpoint, tiny_config

pytest.importorskip("triton", reason="week 12's kernels need the triton package: pip install triton (Linux)")
from nanoserve.kernels.fused import add_rmsnorm, gate_up_silu, rope_write_kv, silu_mul, use_fused_kernels  # noqa: E402
from nanoserve.model.loader import load_model  # noqa: E402

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
    close(add_rmsnorm(x, None, norm.weight, 1e-5), norm(x), dtype)  # no residual: the norm alone
    y_ref, r_ref = norm(x, res)  # the module's own residual form
    close(y_ref, expected, dtype)
    assert torch.equal(r_ref, expected_sum)


@pytest.mark.exercise("rope-write-kv")
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
    q_ref, k_ref, v_ref = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # views into qkv, as in Attention
    q = rope_write_kv(q_ref.view(T, Hq, D), k_ref.view(T, Hkv, D), v_ref.view(T, Hkv, D), cos, sin,
                      cache.k[0], cache.v[0], slots)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_gate_up_silu(dtype, rows):
    """Issue 20: one row runs the gate_up product and SiLU·mul in one kernel (sizes that are not
    multiples of its blocks); more rows take the projection's product, then `silu_mul`."""
    g = torch.Generator().manual_seed(rows)
    proj = torch.nn.Linear(300, 2 * 700, bias=False).to(DEVICE, dtype)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(2 * 700, 300, generator=g) * 0.05)
    x = torch.randn(rows, 300, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        gate, up = proj(x).split(700, dim=-1)
        close(gate_up_silu(x, proj), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.exercise("rope-write-kv")
@pytest.mark.parametrize("past,new", [([5, 2, 9], [1, 1, 1]), ([0, 6, 0], [7, 3, 1])], ids=["decode", "mixed"])
def test_forward_with_fused_kernels_matches_the_model(tmp_path, past, new):
    """One step of three sequences with different pasts (a decode step; a prompt, a chunk over a
    past and a decode token): the fused kernels behind the modules and in the context's write
    give the hidden states and the pool contents of the PyTorch forward pass (float32)."""
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    cfg = model.config
    block = 4
    caches = [PagedKVCache(cfg.num_layers, 16, block, cfg.num_kv_heads, cfg.head_dim, device=DEVICE) for _ in range(2)]
    tables = [[3, 7], [1, 5, 6], [9, 2, 4]]
    for cache in caches:  # the same random past in both pools
        torch.manual_seed(4)
        cache.k.normal_()
        cache.v.normal_()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g).to(DEVICE)
    positions = torch.tensor([p for a, n in zip(past, new) for p in range(a, a + n)], device=DEVICE)
    slots = [t[p // block] * block + p % block for t, a, n in zip(tables, past, new) for p in range(a, a + n)]
    starts = [0, new[0], new[0] + new[1], sum(new)]
    meta = PagedAttentionMetadata.build(slots, starts, [a + n for a, n in zip(past, new)], tables, device=DEVICE)
    with torch.no_grad():
        expected = model(ids, positions, PagedContext(caches[0], meta))
        use_fused_kernels(model)
        states = []
        got = model(ids, positions, PagedContext(caches[1], meta, fused=True), hidden_states_out=states)
        use_fused_kernels(model, on=False)
        assert torch.equal(states[0], model.embed_tokens(ids))  # the fused norm's in-place add left it alone
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for new_pool, ref in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):  # equal up to float32 rounding
        torch.testing.assert_close(new_pool, ref, rtol=1e-5, atol=1e-5)
    others = [s for s in range(16 * block) if s not in slots]  # only the new slots were written
    for new_pool, ref in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):
        assert torch.equal(new_pool.flatten(1, 2)[:, others], ref.flatten(1, 2)[:, others])


@pytest.mark.slow
def test_engine_decode_with_the_merge_in_the_attention_launch(tmp_path):
    """Issue 39 in the engine: decode steps through the CUDA-graph path's static buffers (nothing
    captured on the CPU), whose attention is sized for the longest context and so split; with the
    fused kernels the splits merge in the attention's own launch. Greedy tokens equal those of
    `--no-fused-kernels` (float32), and the split counters are all back to 0."""
    from nanoserve.engine.engine import LLM
    from nanoserve.kernels.fusion import persistent_buffer
    from nanoserve.kernels.paged_attention import choose_num_splits
    from nanoserve.sampling.params import SamplingParams

    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    assert choose_num_splits(1, 2, 1024, torch.device(DEVICE)) > 1 or DEVICE == "cuda"  # the decode step splits
    prompt = torch.randint(0, 4096, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for fused in (False, True):
        llm = LLM(str(path), dtype=torch.float32, device=DEVICE, attention_backend="triton", block_size=16,
                  num_blocks=32, fused_kernels=fused, cuda_graphs=True, max_num_seqs=2)
        assert llm.engine.runner.fused == fused and llm.engine.sampler.one_pass_argmax == fused
        outs[fused] = llm.generate([prompt], params)[0].token_ids
    assert len(outs[True]) == 6 and outs[True] == outs[False]
    assert not persistent_buffer("split counters", torch.device(DEVICE), 1, torch.int32, 0).any()
