"""Week 22 (issue 33): the FP8 KV cache, `--kv-cache-dtype fp8` (nanoserve/attention/fp8_cache.py).

K and V are stored as float8 e4m3 codes with a float16 scale per token and KV head. Checked here
on the CPU: the format (every value within half an e4m3 step of itself), the pool (writes, reads,
blocks moved as bytes), the bytes a block takes and so the blocks a budget holds, the two Triton
kernels through the interpreter (the attention kernel that reads codes and scales against the
PyTorch reference that widens them and attends; the fused write against `Fp8PagedKVCache.write`,
byte for byte), the refusals, and the engine, whose CPU refusal is lifted for the test. The GPU
test at the end runs the engine in bf16 with CUDA graphs against the bf16 cache.
"""

from __future__ import annotations

import pytest
import torch

import nanoserve.engine.config as engine_config
from nanoserve.attention.cpu_pool import CPUKVPool
from nanoserve.attention.fp8_cache import Fp8PagedKVCache, dequantize_kv, kv_bytes_per_block, quantize_kv
from nanoserve.attention.paged import PagedKVCache, paged_attention_reference
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.model.quantized import FP8_MAX, KV_SCALE_FLOOR
from nanoserve.runner.kv_connector import KVConnector
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import LLAMA_3_1_8B, LLAMA_3_2_1B, make_checkpoint, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_FP8 = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)


def rows_of_many_magnitudes(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random rows [..., D] whose scales span six orders of magnitude, as K rows with outliers do."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    return x * torch.logspace(-3, 3, x[..., 0].numel()).view(x.shape[:-1])[..., None]


# ------------------------------------------------------------------------------ the format


@pytest.mark.exercise("fp8-kv")
def test_each_row_lands_on_e4m3s_range_within_half_a_step():
    x = rows_of_many_magnitudes(6, 3, 64)
    codes, scales = quantize_kv(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float16 and scales.shape == (6, 3, 1)
    large = x.abs().amax(dim=-1) >= FP8_MAX * KV_SCALE_FLOOR  # rows whose scale is above the floor
    assert 0 < large.sum() < large.numel()
    assert (codes.float().abs().amax(dim=-1)[large] == FP8_MAX).all()  # each one's largest value on 448
    assert (scales[~large] == KV_SCALE_FLOOR).all()  # the others keep the floor, with smaller codes
    back = codes.float() * scales.float()
    # half an e4m3 step: 1/16 of a normal value; 2^-10 · scale for the subnormal codes below 2^-6 · scale
    bound = torch.maximum(x.abs() / 16, scales.float() * 2.0**-10)
    assert ((back - x).abs() <= bound * 1.0001).all()
    # the codes were chosen against the rounded scale: quantizing the widened rows finds them again
    again, again_scales = quantize_kv(back)
    assert torch.equal(again.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(again_scales, scales)


@pytest.mark.exercise("fp8-kv")
def test_the_worked_example_and_rows_too_small_for_the_scale():
    codes, scale = quantize_kv(torch.tensor([[0.1, -0.5, 2.0, 0.3]]))
    assert scale.item() == 0.00446319580078125  # 2 / 448 = 0.0044642..., as float16
    assert codes.float().tolist() == [[22.0, -112.0, 448.0, 64.0]]
    assert (codes.float() * scale.float()).tolist() == [[0.0981903076171875, -0.4998779296875, 1.99951171875,
                                                         0.28564453125]]
    codes, scale = quantize_kv(torch.zeros(2, 8))  # nothing to scale: the floor, and codes of zero
    assert torch.equal(scale, torch.full((2, 1), KV_SCALE_FLOOR, dtype=torch.float16)) and not codes.float().any()
    codes, scale = quantize_kv(torch.tensor([[1e-3, -2e-3, 5e-4, 0.0]]))  # below 448 · 2^-14: codes under 448
    assert scale.item() == KV_SCALE_FLOOR and codes.float().tolist() == [[16.0, -32.0, 8.0, 0.0]]


# ------------------------------------------------------------------------------ the pool


def fp8_pool(num_layers=2, num_blocks=9, block_size=4, heads=2, head_dim=16, seed=0) -> Fp8PagedKVCache:
    """A pool whose every slot holds random K/V rows of many magnitudes."""
    cache = Fp8PagedKVCache(num_layers, num_blocks, block_size, heads, head_dim, device=DEVICE)
    slots = torch.arange(num_blocks * block_size, device=DEVICE)
    for layer in range(num_layers):
        k = rows_of_many_magnitudes(len(slots), heads, head_dim, seed=seed + layer).to(DEVICE)
        cache.write(layer, slots, k, k.flip(0) * 0.5)
    return cache


def test_the_pool_stores_codes_and_scales_and_reads_them_back_widened():
    cache = Fp8PagedKVCache(2, 6, 4, 2, 16, dtype=torch.bfloat16)
    assert cache.k.dtype == torch.float8_e4m3fn and cache.k_scale.shape == (2, 6, 4, 2)
    assert cache.k_scale.dtype == torch.float16 and cache.dtype == torch.bfloat16
    assert cache.nbytes == 6 * Fp8PagedKVCache.bytes_per_block(2, 4, 2, 16) == 6 * 2 * 2 * 4 * 2 * (16 + 2)
    k, v = rows_of_many_magnitudes(7, 2, 16, seed=1), rows_of_many_magnitudes(7, 2, 16, seed=2)  # positions 0 .. 6
    table = torch.tensor([2, 0])  # the sequence's blocks
    order = torch.tensor([3, 0, 6, 1, 5, 2, 4])  # written out of order, as steps of several sequences would
    slots = table[order // 4] * 4 + order % 4
    cache.write(1, slots, k[order].to(torch.bfloat16), v[order].to(torch.bfloat16))
    keys, values = cache.gather(1, table, 7)
    assert keys.dtype == values.dtype == torch.float32 and keys.shape == (7, 2, 16)
    for got, x in ((keys, k), (values, v)):  # the exact widened codes, in the sequence's order
        codes, scales = quantize_kv(x.to(torch.bfloat16))
        assert torch.equal(got, dequantize_kv(codes, scales[..., 0]))
    assert not cache.k[0].float().any() and torch.equal(cache.k_scale[0], torch.ones(6, 4, 2, dtype=torch.float16))


def test_blocks_move_as_bytes_between_pools_and_through_the_cpu_tier():
    cache = fp8_pool()
    data = cache.read_blocks([4, 1, 7])
    assert data.dtype == torch.uint8 and data.shape == (3, *cache.block_shape) == (3, 2, 2, 4, 2, 18)
    other = Fp8PagedKVCache(2, 9, 4, 2, 16, device=DEVICE)
    other.write_blocks([0, 2, 8], data)
    for pool in ("k", "v"):
        assert torch.equal(getattr(other, pool).view(torch.uint8)[:, [0, 2, 8]],
                           getattr(cache, pool).view(torch.uint8)[:, [4, 1, 7]])
        assert torch.equal(getattr(other, f"{pool}_scale")[:, [0, 2, 8]], getattr(cache, f"{pool}_scale")[:, [4, 1, 7]])
    # the CPU tier's slots are such bytes; an offload then a reload into other blocks is bit for bit
    k, v, ks = cache.k.view(torch.uint8).clone(), cache.v.view(torch.uint8).clone(), cache.k_scale.clone()
    tier = CPUKVPool(cache, 2)
    assert tier.slots.dtype == torch.uint8 and tier.slots.shape == (2, 2, 2, 4, 2, 18)
    tier.copy(cache, [(3, 0), (5, 1)], [])
    tier.copy(cache, [], [(0, 6), (1, 2)])
    assert torch.equal(cache.k.view(torch.uint8)[:, 6], k[:, 3])
    assert torch.equal(cache.v.view(torch.uint8)[:, 2], v[:, 5])
    assert torch.equal(cache.k_scale[:, 6], ks[:, 3])


def test_a_disaggregated_pair_sees_the_kv_dtype_in_the_block_layout():
    """Issue 35's KV connector refuses a peer whose blocks differ: the layout names the FP8 format."""
    fp8, auto = Fp8PagedKVCache(2, 3, 4, 2, 16), PagedKVCache(2, 3, 4, 2, 16)
    fp8_layout = KVConnector.layout(type("C", (), {"cache": fp8})())
    assert fp8_layout != KVConnector.layout(type("C", (), {"cache": auto})())
    assert "float8_e4m3fn with a float16 scale per token and head" in fp8_layout


# ------------------------------------------------------------------------------ the blocks a budget holds


@pytest.mark.parametrize("shape,least", [(LLAMA_3_2_1B, 1.9), (LLAMA_3_1_8B, 1.95)])
def test_fp8_holds_nearly_twice_the_blocks_of_bf16(shape, least):
    """At the same memory, from the model's shape: a token-head row of head_dim bytes and a 2-byte scale
    against 2 · head_dim bytes in bf16 (66 against 128 for the 1B shape's 64: 1.94x)."""
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **shape})
    budget = 60 * 2**30  # about what an 80 GB GPU leaves the pool
    sizes = {kv: kv_bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, kv)
             for kv in ("auto", "fp8")}
    assert sizes["fp8"] == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.head_dim + 2)
    blocks = {kv: budget // size for kv, size in sizes.items()}
    assert blocks["fp8"] >= least * blocks["auto"], blocks


@pytest.fixture()
def fp8_on_the_cpu(monkeypatch):
    """Lift the CPU refusal: the engine's code runs on the CPU (the reference, or Triton's interpreter)."""
    monkeypatch.setattr(engine_config, "check_fp8_kv", lambda device: None)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fp8kv") / "ckpt", tiny_config(num_hidden_layers=2))


def test_the_engine_sizes_its_pool_from_the_smaller_blocks(ckpt, fp8_on_the_cpu):
    path, _ = ckpt
    memory = 2**20
    blocks = {kv: LLM(str(path), device="cpu", dtype=torch.bfloat16, kv_cache_memory=memory, kv_cache_dtype=kv,
                      block_size=4).engine.runner.cache.num_blocks for kv in ("auto", "fp8")}
    # tiny_config: 2 layers, 2 KV heads of 16 dims (a small head_dim pays the scale more: 32 / 18 = 1.78x)
    assert blocks == {"auto": memory // (2 * 2 * 4 * 2 * 16 * 2), "fp8": memory // (2 * 2 * 4 * 2 * (16 + 2))}


# ------------------------------------------------------------------------------ the kernels

pytest.importorskip("triton", reason="the FP8 KV kernels need the triton package: pip install triton (Linux)")
from nanoserve.kernels.fused import rope_write_kv_fp8  # noqa: E402
from nanoserve.kernels.paged_attention import paged_attention  # noqa: E402
from nanoserve.model.layers import apply_rope  # noqa: E402
from nanoserve.testing import random_paged_step  # noqa: E402


def check_kernel(seqs, num_heads, num_kv_heads, head_dim, dtype=torch.float32, num_splits=None, window=None,
                 atol=2e-5):
    """The kernel over an FP8 pool against the reference, which widens codes · scale and attends."""
    auto, _, tables, starts, lens, q = random_paged_step(seqs, 16, num_heads, num_kv_heads, head_dim, dtype, DEVICE,
                                                         spare_blocks=5)
    cache = Fp8PagedKVCache(1, auto.num_blocks, 16, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    slots = torch.arange(auto.num_blocks * 16, device=DEVICE)
    magnitudes = torch.logspace(-2, 1, len(slots), device=DEVICE)[torch.randperm(len(slots), device=DEVICE)]
    cache.write(0, slots, auto.k[0].flatten(0, 1) * magnitudes[:, None, None].to(dtype), auto.v[0].flatten(0, 1))
    expected = paged_attention_reference(q.float(), cache, 0, starts, lens, tables, window=window)
    out = paged_attention(q, cache.k[0], cache.v[0], tables, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                          torch.tensor(lens, dtype=torch.int32, device=DEVICE), max(n for _, n in seqs), max(lens),
                          num_splits=num_splits, window=window, k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_the_kernel_reads_codes_and_scales_as_the_reference_widens_them(num_splits):
    """Decode, fresh prompts, a chunk over a past, a guess over a short one; with context splits too."""
    check_kernel([(40, 1), (0, 17), (90, 20), (7, 5), (130, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
                 num_splits=num_splits)


def test_the_kernel_with_the_1b_heads_and_a_sliding_window():
    check_kernel([(300, 1), (0, 24)], num_heads=32, num_kv_heads=8, head_dim=64)
    check_kernel([(100, 1), (20, 30)], num_heads=4, num_kv_heads=2, head_dim=32, window=24)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if GPU_FP8 else []))
def test_the_fused_write_stores_the_same_codes_and_scales(dtype):
    """Week 12's fused RoPE + K/V write, into an FP8 pool: byte for byte what `write` stores."""
    Hq, Hkv, D, T = 4, 2, 32, 5
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=g) * torch.logspace(-2, 2, T)[:, None]).to(DEVICE, dtype)
    angles = torch.rand(T, D // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))  # views, as in Attention
    slots = torch.tensor([5, 0, 14, 15, 9], device=DEVICE)
    fused, reference = (Fp8PagedKVCache(1, 4, 4, Hkv, D, dtype=dtype, device=DEVICE) for _ in range(2))
    q_out = rope_write_kv_fp8(q, k, v, cos, sin, fused.k[0], fused.v[0], slots, fused.k_scale[0], fused.v_scale[0])
    reference.write(0, slots, apply_rope(k, cos, sin), v)
    assert torch.equal(q_out, apply_rope(q, cos, sin))
    for pool in ("k", "v"):
        assert torch.equal(getattr(fused, pool).view(torch.uint8), getattr(reference, pool).view(torch.uint8)), pool
        assert torch.equal(getattr(fused, f"{pool}_scale"), getattr(reference, f"{pool}_scale")), pool


# ------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("options,message", [
    (dict(device="cpu"), "on the CPU keep --kv-cache-dtype auto"),
    (dict(device="cuda"), "compute capability 8.9 or more.*this GPU is 8.0"),
    (dict(kv_cache_dtype="int8"), "unknown kv_cache_dtype 'int8': one of auto, fp8"),
])
def test_refused_on_the_cpu_and_on_gpus_without_fp8_in_one_line(monkeypatch, options, message):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=message) as refused:
        EngineConfig(**{"kv_cache_dtype": "fp8", **options})
    assert "\n" not in str(refused.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert EngineConfig(device="cuda", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"  # an H100 takes it


def test_the_command_line_refuses_it_on_the_cpu(capsys):
    from nanoserve.cli import main

    assert main(["generate", "hello", "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("on the CPU keep --kv-cache-dtype auto"), err


def generate(path, prompts, max_tokens=6, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device=DEVICE, dtype=torch.float32, block_size=4, max_num_seqs=8, max_model_len=128,
              **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


PROMPTS = [torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 14)]


@pytest.mark.slow
def test_the_engine_with_the_kernels_and_static_buffers_gives_the_references_tokens(ckpt, fp8_on_the_cpu):
    """Triton's attention and fused write over the FP8 pool, decode steps from week 12's static buffers
    (captured on a GPU), against the PyTorch reference over the same pool: the same greedy tokens."""
    path, _ = ckpt
    prompts = PROMPTS[1:]  # a prompt of 9 tokens and one of 14: partly filled blocks, a mixed step
    # Steps of at most 16 tokens: a mixed step's graph buffers are padded to 16, not 64 (the interpreter is slow).
    same = dict(max_tokens=4, kv_cache_dtype="fp8", num_blocks=32, max_num_batched_tokens=16)
    reference, _ = generate(path, prompts, attention_backend="torch", **same)
    kernels, llm = generate(path, prompts, attention_backend="triton", cuda_graphs=True, fused_kernels=True, **same)
    assert llm.engine.runner.graphs.mixed_sizes == [16]
    assert type(llm.engine.runner.cache) is Fp8PagedKVCache and llm.engine.runner.graphs is not None
    assert kernels == reference


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """The share of the `outputs` positions at which `llm`'s most likely token, given the prompt and the
    outputs before it, is the output token (prompt logprobs: one prefill over prompt + outputs)."""
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    scored = llm.generate([p + o for p, o in zip(prompts, outputs)], scoring, use_tqdm=False)
    hits = [lp.top[0][0] == lp.token for s, p in zip(scored, prompts) for lp in s.prompt_logprobs[len(p):]]
    return sum(hits) / len(hits)


def test_fp8_keeps_the_top_token_at_most_positions(fp8_on_the_cpu):
    """What it does to accuracy, on the bundled tiny model in float32: teacher forced over the auto
    cache's greedy outputs, the FP8 cache's top token is the same at most positions (0.98 here; free
    running, one changed token changes the rest of its sequence, which says little)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (6, 20, 45, 90)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llms = {kv: LLM("tiny", device="cpu", dtype=torch.float32, attention_backend="torch", num_blocks=64,
                    kv_cache_dtype=kv) for kv in ("auto", "fp8")}
    auto = [o.token_ids for o in llms["auto"].generate(prompts, greedy, use_tqdm=False)]
    assert teacher_forced_agreement(llms["auto"], prompts, auto) == 1.0  # its own tokens: the measure's zero
    assert teacher_forced_agreement(llms["fp8"], prompts, auto) >= 0.9


def test_fp8_survives_preemption_and_prefix_caching(ckpt, fp8_on_the_cpu):
    """Blocks are blocks: shared by the prefix cache, or freed by a preemption and computed again, they
    hold the same codes, and the greedy tokens are those of a roomy pool without sharing."""
    path, _ = ckpt
    prompts = PROMPTS + [PROMPTS[1] + [7, 8, 9, 10, 11]]  # a shared prefix of 2 full blocks
    roomy, _ = generate(path, prompts, max_tokens=10, kv_cache_dtype="fp8", attention_backend="torch", num_blocks=64,
                        enable_prefix_caching=False)
    tight, llm = generate(path, prompts, max_tokens=10, kv_cache_dtype="fp8", attention_backend="torch",
                          num_blocks=12, enable_prefix_caching=True)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.prefix_cache_stats()["hit_tokens"] > 0
    assert tight == roomy


def test_fp8_with_speculation_and_a_cpu_tier_gives_the_same_tokens(fp8_on_the_cpu):
    """A token's codes depend on its row alone, not on the step that wrote it: k + 1 tokens verified at
    once (week 17) store what one token a step stores; blocks offloaded to the CPU tier and brought
    back (issue 35) come back as the same bytes. Both give plain fp8's greedy tokens."""
    text = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7 + [12]]  # repetitive: prompt lookup finds guesses
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fp8 = dict(device="cpu", dtype=torch.float32, attention_backend="torch", kv_cache_dtype="fp8")
    plain = [o.token_ids for o in LLM("tiny", num_blocks=64, **fp8).generate(text, greedy, use_tqdm=False)]
    spec = LLM("tiny", num_blocks=64, speculative="ngram", num_speculative_tokens=3, **fp8)
    assert [o.token_ids for o in spec.generate(text, greedy, use_tqdm=False)] == plain
    assert spec.engine.spec_stats()["accepted"] > 0
    tier = LLM("tiny", num_blocks=11, block_size=4, enable_prefix_caching=True, cpu_offload_gb=0.001, **fp8)
    first = [o.token_ids for o in tier.generate(text[:1], greedy, use_tqdm=False)]
    evicting = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # 11 blocks: every cached one goes
    tier.generate([[100 + i for i in range(40)]], evicting, use_tqdm=False)
    assert [o.token_ids for o in tier.generate(text[:1], greedy, use_tqdm=False)] == first == plain[:1]
    assert tier.engine.prefix_cache_stats()["reloads"] > 0


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_on_a_gpu_fp8_keeps_the_greedy_tokens_of_bf16_in_cuda_graphs():
    """The bundled tiny model in bf16, CUDA graphs and fused kernels on: the bf16 cache's greedy tokens,
    then the FP8 cache's. Each cache also scores the bf16 cache's outputs (prompt logprobs, teacher
    forced): the share of positions whose top token is the one bf16 chose is the accuracy measure."""
    if not GPU_FP8:
        pytest.skip("--kv-cache-dtype fp8 needs compute capability 8.9 or more (Ada, Hopper)")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (5, 17, 40, 64, 100, 130, 200, 300)]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs, agreement = {}, {}
    for kv in ("auto", "fp8"):
        llm = LLM("tiny", kv_cache_dtype=kv, max_num_seqs=16, gpu_memory_utilization=0.3)
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.capture and type(llm.engine.runner.cache).kv_cache_dtype == kv
        replays = []

        def counted(*args, run=graphs.run, replays=replays, **kwargs):
            replays.append(1)
            return run(*args, **kwargs)

        graphs.run = counted
        outputs[kv] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert len(replays) >= 31  # the decode steps ran as graph replays
        agreement[kv] = teacher_forced_agreement(llm, prompts, outputs["auto"])
        llm.close()
    same = sum(a == b for x, y in zip(outputs["auto"], outputs["fp8"]) for a, b in zip(x, y))
    print(f"teacher-forced top-1 agreement with bf16's tokens: bf16 cache {agreement['auto']:.3f}, "
          f"fp8 cache {agreement['fp8']:.3f}; free-running greedy tokens equal at {same} of {32 * len(prompts)}")
    assert agreement["fp8"] >= 0.9 and agreement["fp8"] >= agreement["auto"] - 0.05
