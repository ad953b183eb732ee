"""Week 24: the router's rules at their edges, and the grouped expert kernels (through Triton's
interpreter on the CPU, compiled on a GPU) against the per-expert loop: tokens grouped by expert,
padded to the block size, every block one expert's; then the engine with the kernels swapped in."""

import pytest
import torch

from nanoserve.model.moe import combine, experts_loop, route

pytest.importorskip("triton", reason="week 24's kernels need the triton package: pip install triton (Linux)")
from nanoserve.kernels.moe import align_by_expert, align_by_expert_triton, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------- the router


@pytest.mark.exercise("top-k-route")
def test_ties_go_to_the_lower_expert():
    """A router of zeros ties every expert: each token goes to experts 0..k-1, with equal weights
    (1/k renormalized; 1/E, the softmax's, without). `torch.topk` leaves the choice unspecified."""
    weights, ids = route(torch.zeros(5, 8), top_k=2, renormalize=True)
    assert ids.tolist() == [[0, 1]] * 5 and torch.equal(weights, torch.full((5, 2), 0.5))
    weights, ids = route(torch.zeros(3, 16), top_k=4, renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3]] * 3 and torch.allclose(weights, torch.full((3, 4), 1 / 16))
    _, ids = route(torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0]]), top_k=3, renormalize=True)
    assert ids.tolist() == [[1, 3, 2]]  # two ties, each to its lower id


@pytest.mark.exercise("top-k-route")
def test_weights_are_the_softmax_of_the_chosen():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(-1)
    weights, ids = route(logits, 2, renormalize=False)
    assert torch.equal(ids, probs.topk(2).indices) and torch.allclose(weights, probs.topk(2).values)
    renormalized, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(renormalized.sum(-1), torch.ones(6)) and torch.allclose(renormalized, weights / weights.sum(-1, True))


@pytest.mark.exercise("moe-combine")
def test_combine_is_the_weighted_sum_of_each_tokens_rows():
    """The lesson's worked example: rows are token-major (pair p is token p // k, slot p % k); each
    token's k rows are summed with its weights, in float32 whatever the rows' dtype."""
    pair_out = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    assert combine(pair_out, weights).tolist() == [[1.5, 2.5], [6.0, 7.0]]
    out = combine(pair_out.bfloat16(), weights)
    assert out.dtype == torch.float32 and out.tolist() == [[1.5, 2.5], [6.0, 7.0]]
    three = torch.arange(18.0).view(6, 3)  # T = 2, k = 3
    assert combine(three, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])).tolist() == [[0.0, 1.0, 2.0], [30.0, 32.0, 34.0]]
    assert combine(torch.zeros(0, 4), torch.zeros(0, 2)).shape == (0, 4)


def swiglu(x, w13, w2):
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.T


@pytest.mark.exercise("expert-loop")
def test_loop_is_the_weighted_sum_of_each_tokens_experts():
    """The reference itself, against its definition written out token by token."""
    g = torch.Generator().manual_seed(1)
    x, w13, w2 = torch.randn(5, 16, generator=g), torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    weights, ids = route(torch.randn(5, 4, generator=g), 2, True)
    expected = torch.stack([sum(w * swiglu(x[t], w13[e], w2[e]) for w, e in zip(weights[t], ids[t].tolist()))
                            for t in range(5)])
    torch.testing.assert_close(experts_loop(x, w13, w2, weights, ids), expected)
    torch.testing.assert_close(combine(torch.ones(10, 3), weights), torch.ones(5, 3))


# ----------------------------------------------------------------------------------- the alignment


@pytest.mark.exercise("align-tokens")
def test_align_by_expert_by_hand():
    """Pairs (token·k + slot): expert 0 has 0 and 5, expert 1 has 3, expert 2 has 1, 2, 4; expert 3 none.
    Blocks of 4: one each for experts 0, 1 and 2; the rest, up to the most padding could take, none."""
    pairs, block_expert = align_by_expert(torch.tensor([[0, 2], [2, 1], [2, 0]]), num_experts=4, block_m=4)
    pad = 6
    assert pairs.tolist() == [0, 5, pad, pad, 3, pad, pad, pad, 1, 2, 4] + [pad] * 9
    assert block_expert.tolist() == [0, 1, 2, -1, -1]


@pytest.mark.exercise("align-tokens")
@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 2, 8, 16), (37, 4, 16, 16), (64, 2, 8, 64), (9, 1, 3, 4)])
def test_every_pair_lands_once_in_a_block_of_its_expert(tokens, k, experts, block_m):
    ids = torch.randint(0, experts, (tokens, k), generator=torch.Generator().manual_seed(tokens))
    pairs, block_expert = align_by_expert(ids, experts, block_m)
    real = pairs < tokens * k
    assert sorted(pairs[real].tolist()) == list(range(tokens * k))
    assert pairs.numel() % block_m == 0 and block_expert.numel() == pairs.numel() // block_m
    owner = block_expert.repeat_interleave(block_m)
    assert torch.equal(owner[real], ids.flatten()[pairs[real].long()].int())
    used = block_expert[block_expert >= 0]
    assert torch.equal(used, used.sort().values)  # blocks in expert order, then the unused ones


# --------------------------------------------------------------- the alignment in two Triton kernels


def aligned_by_hand(ids, experts, block_m):
    """The contract written out in Python: each expert's pairs in increasing order, its group from a
    multiple of block_m, the sentinel T·k elsewhere, -1 for blocks past the last group."""
    flat = ids.flatten().tolist()
    size = -(-(len(flat) + experts * (block_m - 1)) // block_m) * block_m
    pairs, owners = [], []
    for e in range(experts):
        group = [p for p, chosen in enumerate(flat) if chosen == e]
        group += [len(flat)] * (-len(group) % block_m)
        pairs += group
        owners += [e] * (len(group) // block_m)
    return pairs + [len(flat)] * (size - len(pairs)), owners + [-1] * (size // block_m - len(owners))


def check_alignment_kernel(ids, experts, block_m):
    pairs, block_expert = align_by_expert_triton(ids.to(DEVICE), experts, block_m)
    assert pairs.dtype == block_expert.dtype == torch.int32 and pairs.device.type == DEVICE
    assert (pairs.tolist(), block_expert.tolist()) == aligned_by_hand(ids, experts, block_m)


def test_alignment_kernel_on_the_lessons_examples():
    pad = 6
    pairs, block_expert = align_by_expert_triton(torch.tensor([[0, 2], [2, 1], [2, 0]], device=DEVICE), 4, 4)
    assert pairs.tolist() == [0, 5, pad, pad, 3, pad, pad, pad, 1, 2, 4] + [pad] * 9
    assert block_expert.tolist() == [0, 1, 2, -1, -1]
    pairs, block_expert = align_by_expert_triton(torch.tensor([[1], [1], [1]], device=DEVICE), 2, 2)
    assert pairs.tolist() == [0, 1, 2, 3, 3, 3] and block_expert.tolist() == [1, 1, -1]


@pytest.mark.parametrize("tokens,k,experts,block_m", [
    (1, 1, 8, 16),  # a single pair
    (1, 2, 8, 16),  # one decode row
    (37, 4, 16, 16),
    (9, 1, 3, 4),
    (64, 2, 8, 1),  # blocks of one row: no padding at all
    (1500, 2, 8, 64),  # 3,000 pairs: three chunks of 1,024
    (700, 4, 60, 16),  # Qwen1.5-MoE's 60 experts of 4: chunks of 128 pairs
    (600, 4, 256, 16),  # 75 chunks of 32: the count table read in three tiles
])
def test_alignment_kernel_keeps_the_contract(tokens, k, experts, block_m):
    """Random routings: the same lists as the contract written out (so as `align_by_expert`'s, order included)."""
    ids = torch.randint(0, experts, (tokens, k), generator=torch.Generator().manual_seed(tokens + experts))
    check_alignment_kernel(ids, experts, block_m)


@pytest.mark.parametrize("name", ["all to one expert", "ties", "some experts empty", "group of exactly block_m"])
def test_alignment_kernel_on_skewed_routings(name):
    g = torch.Generator().manual_seed(3)
    ids = {"all to one expert": torch.full((300, 1), 5),
           "ties": torch.tensor([[0, 1]] * 40),  # a router of zeros: every token to experts 0 and 1
           "some experts empty": torch.tensor([1, 3, 6])[torch.randint(0, 3, (50, 2), generator=g)],
           "group of exactly block_m": torch.tensor([[0, 2]] * 16)}[name]
    check_alignment_kernel(ids, 8, 16)


def test_alignment_kernel_with_no_pairs():
    """No pair (fused_moe returns before aligning; the kernels still give the contract's lists)."""
    pairs, block_expert = align_by_expert_triton(torch.zeros(0, 2, dtype=torch.long, device=DEVICE), 8, 16)
    assert pairs.tolist() == [0] * 128 and block_expert.tolist() == [-1] * 8


@pytest.mark.gpu
def test_alignment_kernel_replays_in_a_cuda_graph():
    """Captured once, replayed on three routings of the same shape: each replay gives that routing's lists."""
    ids = torch.zeros(64, 2, dtype=torch.long, device="cuda")
    align_by_expert_triton(ids, 8, 16)  # compile before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pairs, block_expert = align_by_expert_triton(ids, 8, 16)
    for seed in range(3):
        routing = torch.randint(0, 8 if seed else 2, (64, 2), generator=torch.Generator().manual_seed(seed))
        ids.copy_(routing)
        graph.replay()
        assert (pairs.tolist(), block_expert.tolist()) == aligned_by_hand(routing, 8, 16)


# ----------------------------------------------------------------------------------- the kernels


def moe_inputs(tokens, hidden, inter, experts, k, seed=0, logits=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, ids = route(torch.randn(tokens, experts, generator=g) if logits is None else logits, k, True)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


@pytest.mark.exercise("grouped-gate-up")
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [
    (1, 64, 32, 8, 2),  # one decode row: two experts busy, six idle
    (7, 48, 40, 16, 4),  # ragged sizes: every mask at work; many experts, some empty
    (40, 64, 96, 8, 2),  # more rows than one block for most experts
    (20, 32, 16, 4, 1),  # top-1
])
def test_fused_kernels_equal_the_loop(tokens, hidden, inter, experts, k):
    x, w13, w2, weights, ids = moe_inputs(tokens, hidden, inter, experts, k)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), experts_loop(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.exercise("grouped-gate-up")
def test_all_tokens_to_one_expert():
    """A router that sends every token to expert 5 first and 2 second (18 rows: two blocks of one
    expert's, the others empty): the kernels, the loop and the two SwiGLUs written out agree."""
    logits = torch.zeros(18, 8)
    logits[:, 5], logits[:, 2] = 4.0, 2.0
    x, w13, w2, weights, ids = moe_inputs(18, 32, 16, 8, 2, logits=logits)
    assert (ids[:, 0] == 5).all() and (ids[:, 1] == 2).all()
    expected = weights[:, :1] * swiglu(x, w13[5], w2[5]) + weights[:, 1:] * swiglu(x, w13[2], w2[2])
    torch.testing.assert_close(experts_loop(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.exercise("grouped-gate-up")
@pytest.mark.parametrize("tokens,hidden,inter,experts,k", [(1, 64, 32, 8, 2), (40, 64, 96, 8, 2), (7, 48, 40, 60, 4)])
def test_fused_kernels_with_the_alignment_kernel_equal_the_loop(tokens, hidden, inter, experts, k):
    """fused_moe aligning by `align_by_expert_triton` (its default on CUDA; asked for here, so the
    interpreter runs it on the CPU too): the loop's output."""
    x, w13, w2, weights, ids = moe_inputs(tokens, hidden, inter, experts, k, seed=tokens)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, align_kernel=True),
                               experts_loop(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_no_tokens():
    x, w13, w2, weights, ids = moe_inputs(0, 32, 16, 4, 2)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32) == experts_loop(x, w13, w2, weights, ids).shape


@pytest.mark.parametrize("align_kernel", [False, True])
@pytest.mark.parametrize("k", [1, 2])
def test_an_id_past_the_last_expert_runs_nothing(align_kernel, k):
    """Expert parallelism's fixed-capacity dispatch pads its rows with the id E (no expert): the
    alignment puts those pairs in a group of their own whose blocks run nothing (-1), and the rows
    whose pairs all name an expert are the loop's. Half of 24 tokens are padding, some grouped at
    the end, some between real rows."""
    x, w13, w2, weights, ids = moe_inputs(24, 48, 40, 8, k, seed=k)
    padding = torch.zeros(24, dtype=torch.bool, device=x.device)
    padding[::3], padding[-6:] = True, True
    ids = torch.where(padding[:, None], 8, ids)  # every slot of a padding token: no expert
    real = ~padding
    out = fused_moe(x, w13, w2, weights, ids, align_kernel=align_kernel)
    assert out.shape == x.shape
    loop = experts_loop(x, w13, w2, weights, ids)  # the loop's experts are 0..7: id 8 matches none
    assert loop[padding].abs().max() == 0
    torch.testing.assert_close(out[real], loop[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[real], experts_loop(x[real], w13, w2, weights[real], ids[real]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_engine_with_the_kernels_equals_hf(moe_checkpoints, moe_prompts, hf_greedy):
    """Mixtral through the Triton backend with the fused kernels swapped in (the expert kernels
    among them), chunked steps mixing prompts and decodes: HF's tokens."""
    from nanoserve.engine.engine import LLM
    from nanoserve.kernels.moe import fused_moe as kernel
    from nanoserve.sampling.params import SamplingParams

    path, hf = moe_checkpoints["mixtral"]
    llm = LLM(str(path), dtype=torch.float32, device=DEVICE, attention_backend="triton", num_blocks=32, block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=24, max_num_seqs=2, fused_kernels=True,
              cuda_graphs=False)
    assert all(layer.mlp.kernel is kernel for layer in llm.engine.model.layers)
    ps = [moe_prompts[2], moe_prompts[0][:17]]
    outs = [o.token_ids for o in llm.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    hf = hf.to(DEVICE)
    assert outs == [hf_greedy(hf, p, 4) for p in ps]
    hf.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_fused_kernels_in_bfloat16_on_the_gpu(tokens):
    """Compiled, in bfloat16, at the block sizes the GPU picks (16 to 64 rows): within bf16's rounding of the loop."""
    x, w13, w2, weights, ids = moe_inputs(tokens, 512, 384, 8, 2)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    got, expected = fused_moe(x, w13, w2, weights, ids).float(), experts_loop(x, w13, w2, weights, ids).float()
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


def load_bench():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_benchmark_script_runs_on_a_tiny_block(capsys):
    """`scripts/bench_moe.py --tiny` (the GPU benchmark's smoke test): a table, exit code 0."""
    assert load_bench().main(["--tiny", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "loop/fused" in out and "torch al." in out and "\n      8      16 " in out


@pytest.mark.slow
def test_the_benchmark_script_in_separate_processes(capsys, tmp_path):
    """`--processes 2`: two children, each measuring once; the medians with their ranges, as JSON too."""
    import json

    assert load_bench().main(["--tiny", "--tokens", "8", "--processes", "2", "--json-out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "process 2/2: done" in out and "medians across 2 separate processes" in out
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert row["tokens"] == 8 and row["runs"] == 2
    for figure in ("loop_ms", "fused_ms", "align_ms", "align_torch_ms", "dense_ms"):
        assert row[figure + "_min"] <= row[figure] <= row[figure + "_max"]


def test_the_benchmark_sweep_on_a_tiny_block(tmp_path):
    """`--sweep --tiny`: every candidate tile timed (through the interpreter) and the best one named."""
    import json

    assert load_bench().main(["--tiny", "--sweep", "--tokens", "8", "--sweep-out", str(tmp_path / "s.json")]) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert len(result["rows"]) == 2 and all(r["rel_error"] < 1e-4 and r["fused_ms"] > 0 for r in result["rows"])
    assert result["best"]["8"]["fused_ms"] == min(r["fused_ms"] for r in result["rows"])
    assert result["gpu_tiles"].startswith("GPU_TILES") and 'float("inf")' in result["gpu_tiles"]


def test_the_benchmark_takes_a_sweeps_tiles(tmp_path):
    """`--tiles sweep.json` puts the sweep's table in GPU_TILES for the run (so that the figures after
    a sweep need no edit of the code); the table is restored here afterwards."""
    import json

    from nanoserve.kernels.moe import GPU_TILES, moe_blocks_for

    bench, saved = load_bench(), list(GPU_TILES)
    tiles = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    (tmp_path / "s.json").write_text(json.dumps({"gpu_tiles_entries": [[None, tiles]]}))
    try:
        assert bench.main(["--tiny", "--tokens", "8", "--tiles", str(tmp_path / "s.json")]) == 0
        assert moe_blocks_for(2, 8, interpreted=False) == tiles == moe_blocks_for(10**6, 8, interpreted=False)
    finally:
        GPU_TILES[:] = saved


def test_the_sweeps_table_for_moe_blocks_for():
    """The fastest tiles at 1 .. 4,096 tokens (top-2 of 8) become GPU_TILES: bounds at the geometric
    mean of neighbouring counts' rows per expert, equal neighbours merged, the last bound infinite."""
    from nanoserve.kernels import moe

    bench = load_bench()
    small, large = (16, 64, 64, 4, 3), (64, 128, 64, 8, 4)
    best = {t: dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), small if t < 256 else large))
            for t in (1, 16, 64, 256, 1024, 4096)}
    text = bench.tiles_text(bench.suggested_tiles(best, top_k=2, num_experts=8))
    namespace = {}
    exec(text, {}, namespace)
    assert namespace["GPU_TILES"] == [(32.0, best[1]), (float("inf"), best[4096])]  # sqrt(64 * 256) * 2 / 8 = 32
    assert [bound for bound, _ in moe.GPU_TILES][-1] == float("inf")
