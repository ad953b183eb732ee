"""Issue 39: at batch 1 each add + RMSNorm folds into the product after it (`nanoserve/kernels/normed_gemv.py`).

Each kernel against the PyTorch code it replaces (the add and the norm of nanoserve/model/layers.py,
then the product), in float32, with and without a residual, with a bias, on sizes that are neither
powers of two nor multiples of the blocks; the `DecoderLayer` hook against the layer's own forward,
and where it must decline; then greedy decoding of a tiny model through the engine, with and without
the fused kernels, token for token. On the CPU the kernels run in Triton's interpreter.
"""

import pytest
import torch
import torch.nn.functional as F

from nanoserve.attention.base import causal_attention
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import DecoderLayer, FamilyAttention, RMSNorm, RotaryEmbedding, apply_rope
from nanoserve.testing import make_checkpoint, tiny_config

pytest.importorskip("triton", reason="week 12's kernels need the triton package: pip install triton (Linux)")
from nanoserve.kernels import fusion  # noqa: E402
from nanoserve.kernels.normed_gemv import (  # noqa: E402
    NORMED_GEMV_BLOCKS, fused_decoder_layer, gate_up_silu_row, normed_gate_up_silu, normed_gemv, normed_qkv_rope,
    row_gemv)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def every_fusion_on():
    """Both norm fusions on for every test here, whatever NANOSERVE_FUSE_OFF says."""
    fusion.switch_fusions("")
    yield
    fusion.switch_fusions(None)


def close(a, b):  # float32: the same rounding points, only the order of a sum differs
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def random_norm(hidden: int, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5).to(DEVICE)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE)
    return norm


def stream(hidden: int, g: torch.Generator, with_residual: bool):
    x = torch.randn(1, hidden, generator=g).to(DEVICE)
    return x, (torch.randn(1, hidden, generator=g).to(DEVICE) if with_residual else None)


@pytest.mark.parametrize("config", [None, (8, 512, 2)], ids=["tuned-blocks", "two-tiles"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@torch.no_grad()
def test_normed_gemv_is_the_norm_then_the_product(with_residual, bias, config):
    """H = 600, N = 37 (not a multiple of BLOCK_N): with the tuned blocks one tile of K, partly masked;
    with BLOCK_K = 512 two tiles, the second partly masked."""
    block_n, block_k, _ = config or NORMED_GEMV_BLOCKS
    assert 37 % block_n and (600 < block_k if config is None else block_k < 600 < 2 * block_k)
    g = torch.Generator().manual_seed(1 + with_residual + 2 * bias)
    norm = random_norm(600, g)
    proj = torch.nn.Linear(600, 37, bias=bias).to(DEVICE)
    proj.weight.copy_(torch.randn(37, 600, generator=g) * 0.05)
    if bias:
        proj.bias.copy_(torch.randn(37, generator=g))
    x, residual = stream(600, g, with_residual)
    before = None if residual is None else residual.clone()
    y, new_residual = normed_gemv(x, residual, norm, proj, config=config)
    if residual is None:  # the first layer: x is the whole stream, and stays the residual
        close(y, proj(norm(x)))
        assert new_residual is x
    else:
        h, expected_sum = norm(x, residual)  # the module's own add, then its norm
        close(y, proj(h))
        assert torch.equal(new_residual, expected_sum)  # one rounded add, as the reference's
        assert torch.equal(residual, before) and new_residual.data_ptr() != residual.data_ptr()  # a fresh tensor


@pytest.mark.parametrize("config", [(4, 2048, 4), (8, 256, 2), (1, 4096, 8)], ids=["one-tile", "tiles", "one-row"])
@torch.no_grad()
def test_row_gemv_is_the_product(config):
    """`row_gemv` (o_proj and down_proj at batch 1, switch `row-gemv`): x·Wᵀ, for sizes that are no
    multiple of the blocks (the last program's rows and the last tile's columns masked)."""
    g = torch.Generator().manual_seed(11)
    for n_out, k_dim in ((200, 328), (72, 1000)):
        proj = torch.nn.Linear(k_dim, n_out, bias=False).to(DEVICE)
        proj.weight.data = torch.randn(n_out, k_dim, generator=g).to(DEVICE)
        x = torch.randn(1, k_dim, generator=g).to(DEVICE)
        got = row_gemv(x, proj, config)
        assert got.shape == (1, n_out)
        torch.testing.assert_close(got, F.linear(x, proj.weight), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_hook_keeps_a_projection_that_is_not_plain():
    """With `row-gemv` on, an o_proj or down_proj that is more than x·Wᵀ (LoRA, quantized: here a
    subclass that adds one) still runs its own forward inside the hook."""
    cfg = layer_config()
    x, residual, cos, sin, ctx = layer_inputs(cfg, torch.Generator().manual_seed(12), True)

    class PlusOne(torch.nn.Linear):
        def forward(self, h):
            return super().forward(h) + 1.0

    for name in ("o", "down"):
        layer = random_layer(cfg)
        owner, attr = (layer.self_attn, "o_proj") if name == "o" else (layer.mlp, "down_proj")
        old = getattr(owner, attr)
        new = PlusOne(old.in_features, old.out_features, bias=False).to(DEVICE)
        new.weight.data = old.weight.data.clone()
        setattr(owner, attr, new)
        expected = layer(x, residual, cos, sin, ctx)
        got = fused_decoder_layer(layer, x, residual, cos, sin, ctx)
        close(got[0], expected[0])
        close(got[1], expected[1])


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@torch.no_grad()
def test_normed_gate_up_silu(with_residual):
    """H = 1100: two tiles of BLOCK_K = 1024; I = 37: not a multiple of BLOCK_N. The plain form
    (issue 20's, without the prologue) on the same weight, too."""
    g = torch.Generator().manual_seed(5 + with_residual)
    norm = random_norm(1100, g)
    w = (torch.randn(2 * 37, 1100, generator=g) * 0.05).to(DEVICE)
    x, residual = stream(1100, g, with_residual)
    y, new_residual = normed_gate_up_silu(x, residual, norm, w)
    h, expected_sum = norm(x, residual) if with_residual else (norm(x), x)
    gate, up = (h @ w.T).split(37, dim=-1)
    close(y, F.silu(gate) * up)
    assert torch.equal(new_residual, expected_sum)
    gate, up = (x @ w.T).split(37, dim=-1)
    close(gate_up_silu_row(x, w), F.silu(gate) * up)


# --------------------------------------------------------------------------- the decoder-layer hook


class PastContext:
    """One sequence with a random past of keys and values (already rotated): the new token attends to
    them and to itself, so q, k and v each change the output. Writes nothing."""

    def __init__(self, cfg: ModelConfig, past: int, g: torch.Generator, dtype=torch.float32):
        shape = (past, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = (torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(2))

    def attend(self, layer_idx, q, k, v, cos, sin, window=None, scale=None):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return causal_attention(q, torch.cat([self.k, k]), torch.cat([self.v, v]), q_start=len(self.k))


def layer_config(**overrides) -> ModelConfig:
    """A small layer: hidden 96 (not a power of two), GQA 4:2, head_dim 8."""
    shape = dict(vocab_size=64, hidden_size=96, intermediate_size=40, num_layers=1, num_heads=4, num_kv_heads=2,
                 head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                 tie_word_embeddings=True)
    return ModelConfig(**{**shape, **overrides})


@torch.no_grad()
def random_layer(cfg: ModelConfig, seed: int = 0) -> DecoderLayer:
    torch.manual_seed(seed)
    layer = DecoderLayer(cfg, 0)
    for name, p in layer.named_parameters():
        p.uniform_(0.8, 1.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    return layer.to(DEVICE)


def layer_inputs(cfg: ModelConfig, g: torch.Generator, with_residual: bool, past: int = 5):
    x, residual = stream(cfg.hidden_size, g, with_residual)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([past], device=DEVICE), torch.float32)
    return x, residual, cos, sin, PastContext(cfg, past, g)


@pytest.mark.parametrize("off", ["", "qkv-norm", "mlp-norm", "row-gemv"],
                         ids=["both-norms", "mlp-norm-only", "qkv-norm-only", "cublas-o-and-down"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
@torch.no_grad()
def test_hook_is_the_layer(with_residual, bias, off):
    """One row through the hook: the (x, residual) of the layer's own forward (float32), with both
    norms folded and with either one alone (the other runs its own launch)."""
    fusion.switch_fusions(off)
    cfg = layer_config(attention_bias=bias)
    layer = random_layer(cfg)
    x, residual, cos, sin, ctx = layer_inputs(cfg, torch.Generator().manual_seed(7), with_residual)
    expected = layer(x, residual, cos, sin, ctx)  # `fused` is None: week 2's code
    got = fused_decoder_layer(layer, x, residual, cos, sin, ctx)
    assert got is not None
    close(got[0], expected[0])
    close(got[1], expected[1])
    layer.fused = fused_decoder_layer  # and through `DecoderLayer.forward`, as `use_fused_kernels` sets it
    close(layer(x, residual, cos, sin, ctx)[0], expected[0])


def paged_context(cfg: ModelConfig, past: int, g: torch.Generator, slot: int, dtype=torch.float32):
    """Week 12's real paged context (Triton read, fused write) for one sequence of `past` cached tokens
    in blocks of 4, random, and one new token at `slot` (the next free one)."""
    from nanoserve.attention.paged import PagedAttentionMetadata, PagedKVCache
    from nanoserve.attention.triton import TritonPagedContext

    cache = PagedKVCache(1, 4, 4, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=DEVICE)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    blocks = [2, 0, 3]  # not in order: the table decides
    meta = PagedAttentionMetadata.build([blocks[slot // 4] * 4 + slot % 4], [0, 1], [past + 1], [blocks], DEVICE)
    return TritonPagedContext(cache, meta, fused=True)


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-bias"])
@torch.no_grad()
def test_normed_qkv_rope_is_the_product_then_the_write(with_residual, bias):
    """One launch: the normed qkv product, RoPE of q and k (pairs d, d + D/2 of a head) and the K/V
    write at the step's slot give what `normed_gemv` then week 12's `rope_write_kv` give: the
    rotated q, the same pool (every other slot untouched) and the same new residual. Six query heads
    and two KV heads of 8 dims: 40 pairs. The default blocks (two pairs a program, K in one tile),
    then 16 pairs a program (each program across heads, the last one ragged) and K in two tiles."""
    from nanoserve.kernels.fused import rope_write_kv

    cfg = layer_config(attention_bias=bias, num_heads=6)
    g = torch.Generator().manual_seed(11 + with_residual + 2 * bias)
    attn, norm = random_layer(cfg).self_attn, random_norm(cfg.hidden_size, g)
    x, residual = stream(cfg.hidden_size, g, with_residual)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([6], device=DEVICE), torch.float32)
    for config in (None, (16, 64, 2)):
        plain, fused = paged_context(cfg, 6, g, 6), paged_context(cfg, 6, g, 6)
        fused.cache.k.copy_(plain.cache.k)
        fused.cache.v.copy_(plain.cache.v)
        qkv, expected_sum = normed_gemv(x, residual, norm, attn.qkv_proj)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        expected_q = rope_write_kv(q.view(1, -1, cfg.head_dim), k.view(1, -1, cfg.head_dim), v.view(1, -1, cfg.head_dim),
                                   cos, sin, plain.cache.k[0], plain.cache.v[0], plain.meta.slot_mapping)
        got_q, got_sum = normed_qkv_rope(x, residual, norm, attn, cos, sin, fused.cache.k[0], fused.cache.v[0],
                                         fused.meta.slot_mapping, config=config)
        close(got_q, expected_q)
        close(fused.cache.k, plain.cache.k)
        close(fused.cache.v, plain.cache.v)
        assert torch.equal(got_sum, expected_sum)


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@torch.no_grad()
def test_hook_writes_the_cache_from_the_product(with_residual):
    """Through the hook on week 12's real paged context: with `qkv-rope` the layer's (x, residual)
    and the pool are those of the hook without it (RoPE and the write in their own kernel); on a
    context without the fused write (a test's, or an FP8 pool) it leaves the write to the context."""
    cfg = layer_config()
    layer = random_layer(cfg)
    g = torch.Generator().manual_seed(12)
    x, residual = stream(cfg.hidden_size, g, with_residual)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([9], device=DEVICE), torch.float32)
    plain, fused = paged_context(cfg, 9, g, 9), paged_context(cfg, 9, g, 9)
    fused.cache.k.copy_(plain.cache.k)
    fused.cache.v.copy_(plain.cache.v)
    before = fused.cache.k.clone()
    fusion.switch_fusions("qkv-rope")
    expected = fused_decoder_layer(layer, x, residual, cos, sin, plain)
    fusion.switch_fusions("")
    got = fused_decoder_layer(layer, x, residual, cos, sin, fused)
    for a, b in zip(got, expected):
        close(a, b)
    assert not torch.equal(fused.cache.k, before)  # the new token's K was written, by the product's launch
    close(fused.cache.k, plain.cache.k)
    close(fused.cache.v, plain.cache.v)


class WrappedLinear(torch.nn.Linear):
    """Stands for a LoRA or quantized projection: a product with more in it than x·Wᵀ."""


@torch.no_grad()
def test_hook_declines_what_it_does_not_fuse():
    """None (the layer's own code runs) for: more than one row; a family's attention (q/k norms,
    windows); a projection that is not a plain product; a bias on gate_up; the fusion switched off
    by NANOSERVE_FUSE_OFF=norm or `switch_fusions`."""
    cfg = layer_config()
    g = torch.Generator().manual_seed(8)
    x, residual, cos, sin, ctx = layer_inputs(cfg, g, True)
    assert fused_decoder_layer(random_layer(cfg), x, residual, cos, sin, ctx) is not None
    rows = torch.randn(2, cfg.hidden_size, generator=g).to(DEVICE)
    assert fused_decoder_layer(random_layer(cfg), rows, rows, cos.expand(2, -1), sin.expand(2, -1), ctx) is None
    family = random_layer(cfg)
    family.self_attn = FamilyAttention(cfg, 0).to(DEVICE)
    wrapped_qkv, wrapped_gate_up, biased = random_layer(cfg), random_layer(cfg), random_layer(cfg)
    wrapped_qkv.self_attn.qkv_proj = WrappedLinear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size).to(DEVICE)
    wrapped_gate_up.mlp.gate_up_proj = WrappedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False).to(DEVICE)
    biased.mlp.gate_up_proj = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size).to(DEVICE)
    for layer in (family, wrapped_qkv, wrapped_gate_up, biased):
        assert fused_decoder_layer(layer, x, residual, cos, sin, ctx) is None


@torch.no_grad()
def test_hook_switched_off_by_the_environment(monkeypatch):
    cfg = layer_config()
    layer = random_layer(cfg)
    x, residual, cos, sin, ctx = layer_inputs(cfg, torch.Generator().manual_seed(9), True)
    monkeypatch.setenv("NANOSERVE_FUSE_OFF", "norm")
    fusion.switch_fusions(None)
    try:
        assert not fusion.fusion_on("qkv-norm") and not fusion.fusion_on("mlp-norm")
        assert fusion.fusion_on("argmax") and fusion.fusion_on("merge")
        assert fused_decoder_layer(layer, x, residual, cos, sin, ctx) is None
        monkeypatch.delenv("NANOSERVE_FUSE_OFF")
        fusion.switch_fusions("all")
        assert fused_decoder_layer(layer, x, residual, cos, sin, ctx) is None
        fusion.switch_fusions("")
        assert fused_decoder_layer(layer, x, residual, cos, sin, ctx) is not None
    finally:
        monkeypatch.delenv("NANOSERVE_FUSE_OFF", raising=False)
        fusion.switch_fusions(None)
    assert fusion.fusion_on("mlp-norm") and fusion.fusion_on("qkv-norm")  # unset: the measured default
    assert fused_decoder_layer(layer, x, residual, cos, sin, ctx) is not None


# --------------------------------------------------------------------------- a whole model, greedy


def counting(hook, calls: list, x_arg: int):
    """`hook` that appends (rows of its x, whether it applied) to `calls` for each call; x is
    argument `x_arg` (a layer's hook gets the layer first)."""
    def wrapped(*args):
        out = hook(*args)
        calls.append((args[x_arg].shape[0], out is not None))
        return out
    return wrapped


@pytest.mark.slow
def test_greedy_decode_with_the_norms_folded(tmp_path):
    """A tiny model (2 layers) decodes greedily through the engine with the fused kernels (Triton
    backend, interpreter) exactly as without them (float32). Every decode step's layers took the
    hook, and their norms' `add_rmsnorm` never ran on a single row (the final norm still does)."""
    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=2))
    prompt = torch.randint(0, 4096, (9,), generator=torch.Generator().manual_seed(10)).tolist()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs, layer_calls, norm_calls = {}, [], []
    for fused in (False, True):
        llm = LLM(str(path), dtype=torch.float32, device=DEVICE, attention_backend="triton", block_size=16,
                  num_blocks=4, fused_kernels=fused, cuda_graphs=False, max_num_seqs=1)
        model = llm.engine.runner.model
        assert all((layer.fused is not None) == fused for layer in model.layers)
        if fused:
            for layer in model.layers:
                layer.fused = counting(layer.fused, layer_calls, 1)
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.fused = counting(norm.fused, norm_calls, 0)
        outs[fused] = llm.generate([prompt], params)[0].token_ids
    assert len(outs[True]) == 5 and outs[True] == outs[False]
    decode_calls = [applied for rows, applied in layer_calls if rows == 1]
    assert len(decode_calls) >= 2 * 4 and all(decode_calls)  # 2 layers, 4 decode steps at least
    assert all(not applied for rows, applied in layer_calls if rows > 1)  # the prompt: the layers' own code
    assert norm_calls and all(rows > 1 for rows, _ in norm_calls)


# --------------------------------------------------------------------------- GPU


def llama_1b_layer_bf16() -> tuple[ModelConfig, DecoderLayer]:
    """A random layer of Llama-3.2-1B's shape in bf16, its weights at the usual scale of trained ones
    (the stream stays O(1))."""
    cfg = layer_config(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64)
    layer = random_layer(cfg).to(torch.bfloat16)
    for name, p in layer.named_parameters():
        if not name.endswith("norm.weight"):
            p.mul_(0.02 / 0.15)
    return cfg, layer


def captured_layer(layer, x, residual, cos, sin, ctx):
    """The hook run once (Triton compiles outside the capture), then captured in a CUDA graph ->
    (the graph, the x and residual that its replays write)."""
    assert fused_decoder_layer(layer, x, residual, cos, sin, ctx) is not None
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_residual = fused_decoder_layer(layer, x, residual, cos, sin, ctx)
    return graph, out, new_residual


@pytest.mark.gpu
@torch.no_grad()
def test_fused_layer_in_a_cuda_graph_bf16():
    """Llama-3.2-1B's layer shape in bf16, compiled: the hook captured in a CUDA graph and replayed on
    new inputs gives the unfused layer's (x, residual) within bf16's tolerance (only the order of
    float32 sums differs, and the roundings that follow from it)."""
    cfg, layer = llama_1b_layer_bf16()
    g = torch.Generator().manual_seed(11)
    ctx = PastContext(cfg, 37, g, torch.bfloat16)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([37], device="cuda"), torch.bfloat16)
    x = torch.randn(1, 2048, generator=g).to("cuda", torch.bfloat16)
    residual = torch.randn(1, 2048, generator=g).to("cuda", torch.bfloat16)
    graph, out, new_residual = captured_layer(layer, x, residual, cos, sin, ctx)
    for _ in range(3):
        x.copy_(torch.randn(1, 2048, generator=g).to("cuda"))
        residual.copy_(torch.randn(1, 2048, generator=g).to("cuda"))
        graph.replay()
        expected, expected_residual = layer(x, residual, cos, sin, ctx)  # `fused` is None: week 2's code
        torch.testing.assert_close(new_residual.float(), expected_residual.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert (out.float() - expected.float()).norm() < 1e-2 * expected.float().norm()


@pytest.mark.gpu
@torch.no_grad()
def test_qkv_rope_in_a_cuda_graph_bf16():
    """Llama-3.2-1B's attention shape in bf16, compiled: the hook with RoPE and the K/V write in the
    qkv product's launch, captured in a CUDA graph on week 12's paged context and replayed on new
    inputs, gives the layer and the pool the hook gives with them in their own kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run on a GPU machine (see README, GPU track)")
    cfg, layer = llama_1b_layer_bf16()
    g = torch.Generator().manual_seed(13)
    plain, fused = (paged_context(cfg, 9, g, 9, torch.bfloat16) for _ in range(2))
    fused.cache.k.copy_(plain.cache.k)  # one past for both
    fused.cache.v.copy_(plain.cache.v)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([9], device="cuda"), torch.bfloat16)
    x = torch.randn(1, 2048, generator=g).to("cuda", torch.bfloat16)
    residual = torch.randn(1, 2048, generator=g).to("cuda", torch.bfloat16)
    fusion.switch_fusions("")
    graph, out, new_residual = captured_layer(layer, x, residual, cos, sin, fused)
    for _ in range(3):
        x.copy_(torch.randn(1, 2048, generator=g).to("cuda"))
        residual.copy_(torch.randn(1, 2048, generator=g).to("cuda"))
        graph.replay()
        fusion.switch_fusions("qkv-rope")
        expected, expected_residual = fused_decoder_layer(layer, x, residual, cos, sin, plain)
        fusion.switch_fusions("")
        torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fused.cache.k.float(), plain.cache.k.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fused.cache.v.float(), plain.cache.v.float(), rtol=2e-2, atol=2e-2)
