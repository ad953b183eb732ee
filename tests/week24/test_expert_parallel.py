"""Week 24: expert parallelism. First the exchange alone, its ranks threads of this process whose
collectives meet at a barrier (the lesson's worked example, then ragged steps over three ranks). Then
two CPU ranks over gloo, each holding half the experts, tokens sent to their experts and back with
all_to_all_single: the same tokens as one rank (and as HF), the same routing counts on the driver; a
router that sends every token to the first rank's experts (the second rank's experts get nothing);
and what expert parallelism refuses, before any process starts. Then the fixed-capacity exchange (what
the engine runs when steps are CUDA graphs): the exact exchange's output on thread ranks, at its worst
case and with ranks that have no token; sizes that depend on the step's token count alone, and no value
read on the host; the engine with the graph path's buffers on gloo ranks (HF's tokens); and, on GPUs,
captured in a CUDA graph."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from nanoserve.cli import build_parser
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.model.expert_parallel import ExpertParallel, check_expert_parallel
from nanoserve.model.moe import experts_loop, moe_blocks, route
from nanoserve.model.tensor_parallel import Group
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_family_model, save_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
COMMON = dict(dtype=torch.float32, device="cpu", num_blocks=64, block_size=4, max_num_seqs=4,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16)


class ThreadGroup(Group):
    """One of N ranks that are threads of this process: all_to_all and all_gather hand tensors over
    through `board` (shared by the N groups) and meet at its barrier. Records what each all_to_all
    received, for the checks."""

    def __init__(self, rank: int, size: int, board: dict):
        super().__init__(rank, size)
        self.board, self.received = board, []

    def _swap(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """parts[r] goes to rank r; returns what each rank sent this one, in rank order."""
        self.board[self.rank] = parts
        self.board["barrier"].wait()
        got = [self.board[r][self.rank] for r in range(self.size)]
        self.board["barrier"].wait()  # everyone has read before anyone posts again
        return got

    def all_to_all(self, x, out_splits=None, in_splits=None):
        got = self._swap(list(x.split(in_splits or [x.shape[0] // self.size] * self.size)))
        assert out_splits is None or [len(g) for g in got] == out_splits, (out_splits, [len(g) for g in got])
        self.received.append(torch.cat(got))
        return self.received[-1]

    def all_gather(self, x, dim=-1):
        return torch.cat(self._swap([x] * self.size), dim=dim)


def on_thread_ranks(size: int, work) -> tuple[list, list[ThreadGroup]]:
    """work(group) on `size` threads at once, one rank each: (their results, their groups)."""
    board = {"barrier": threading.Barrier(size, timeout=60)}
    groups = [ThreadGroup(r, size, board) for r in range(size)]

    def one(group):
        try:
            return work(group)
        except BaseException:
            board["barrier"].abort()  # the other ranks stop waiting for this one
            raise
    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(one, groups)), groups


def expert_weights(experts: int, hidden: int = 16, inter: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(experts, 2 * inter, hidden, generator=g) / 4, torch.randn(experts, hidden, inter, generator=g) / 3


def local_experts(group: ThreadGroup, w13, w2):
    """run_experts for this rank: its own experts' slices of w13 and w2, local ids."""
    per = w13.shape[0] // group.size
    mine = slice(group.rank * per, (group.rank + 1) * per)
    return lambda rows, weights, ids: experts_loop(rows, w13[mine], w2[mine], weights, ids)


@pytest.mark.exercise("ep-dispatch")
def test_the_lessons_exchange_on_two_thread_ranks():
    """Two ranks, four experts (0 and 1 on rank 0, 2 and 3 on rank 1), top-2. Rank 0's tokens chose
    [0, 2], [3, 0], [1, 3]; rank 1's [2, 3], [2, 0]. The counts exchanged, the rows each rank's
    experts receive, and each rank's output: its own tokens through the experts they chose, as the
    loop over all four experts on one rank gives them."""
    w13, w2 = expert_weights(4)
    ids = [torch.tensor([[0, 2], [3, 0], [1, 3]]), torch.tensor([[2, 3], [2, 0]])]
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(len(i), 16, generator=g) for i in ids]
    weights = [torch.rand(len(i), 2, generator=g) for i in ids]

    def work(group):
        r = group.rank
        return ExpertParallel(group, 4).exchange(x[r], weights[r], ids[r], local_experts(group, w13, w2))
    outs, groups = on_thread_ranks(2, work)
    counts = [group.received[0].tolist() for group in groups]
    assert counts == [[2, 1, 1, 0], [1, 2, 2, 1]]  # what ranks 0 and 1 send to each of my two experts
    assert [len(group.received[1]) for group in groups] == [4, 6]  # rows dispatched to each rank
    assert [len(group.received[2]) for group in groups] == [6, 4]  # results back: each rank's t * k pairs
    for r in range(2):
        torch.testing.assert_close(outs[r], experts_loop(x[r], w13, w2, weights[r], ids[r]), rtol=1e-5, atol=1e-5)


@pytest.mark.exercise("ep-dispatch")
@pytest.mark.parametrize("tokens", [7, 2, 1])
def test_a_step_over_three_thread_ranks_equals_one(tokens):
    """Six experts over three ranks, top-2: every rank gets the whole step's output, equal to the
    loop on one rank. With 2 tokens or 1, the last ranks have no token of their own to send."""
    w13, w2 = expert_weights(6, seed=tokens)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 16, generator=g)
    weights, ids = route(torch.randn(tokens, 6, generator=g), 2, renormalize=True)
    outs, _ = on_thread_ranks(3, lambda group: ExpertParallel(group, 6)(x, weights, ids, local_experts(group, w13, w2)))
    expected = experts_loop(x, w13, w2, weights, ids)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def run(path, prompts, **kwargs) -> tuple[list[list[int]], dict]:
    with LLM(str(path), **COMMON, **kwargs) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        alone = [o.token_ids for o in llm.generate(prompts[2:3], GREEDY)]  # one sequence: steps of one token
        return outs + alone, llm.engine.expert_load()


@pytest.mark.exercise("ep-dispatch")
def test_two_ranks_equal_one_and_hf(moe_checkpoints, moe_prompts, hf_greedy):
    """Qwen2-MoE (16 experts: 8 a rank, a shared expert and a dense layer replicated), batches of
    ragged prompts, chunked, cached prefixes, then a lone sequence whose decode steps leave rank 1
    no token of its own."""
    path, hf = moe_checkpoints["qwen2_moe"]
    one, load_one = run(path, moe_prompts)
    two, load_two = run(path, moe_prompts, expert_parallel_size=2)
    assert two == one == [hf_greedy(hf, p, 6) for p in moe_prompts + moe_prompts[2:3]]
    assert load_two == load_one  # the driver routes every token, so its counts are the whole engine's


@pytest.mark.exercise("ep-dispatch")
def test_every_token_to_the_first_ranks_experts(tmp_path, moe_prompts):
    """A Mixtral whose routers are zero: every token ties, and goes to experts 0 and 1, both on rank 0."""
    hf = make_family_model("mixtral")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.zero_()
    path = save_checkpoint(hf, tmp_path / "ckpt")
    one, load_one = run(path, moe_prompts[:2])
    two, load_two = run(path, moe_prompts[:2], expert_parallel_size=2)
    assert two == one and load_two == load_one
    assert all(counts[2:] == [0] * 6 and counts[0] == counts[1] > 0 for counts in load_two.values())


@pytest.mark.parametrize("options,message", [
    (dict(expert_parallel_size=2, tensor_parallel_size=2), "not combined with --tensor-parallel-size"),
    (dict(expert_parallel_size=2, pipeline_parallel_size=2), "not combined with --tensor-parallel-size"),
    (dict(expert_parallel_size=0), "1 \\(off\\) or more"),
])
def test_what_expert_parallelism_refuses(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_models_it_cannot_split_are_refused_before_any_process_starts(moe_checkpoints):
    with pytest.raises(ValueError, match="is a dense model"):
        LLM("tiny", device="cpu", expert_parallel_size=2)
    mixtral = ModelConfig.from_json(moe_checkpoints["mixtral"][0])
    with pytest.raises(ValueError, match="8 experts of each layer to split evenly"):
        check_expert_parallel(mixtral, 3)
    check_expert_parallel(mixtral, 4)
    with pytest.raises(ValueError, match="not supported for mixtures of experts"):
        LLM(str(moe_checkpoints["mixtral"][0]), device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="LoRA adapters on a mixture of experts"):
        LLM(str(moe_checkpoints["mixtral"][0]), device="cpu", max_loras=1)


def test_the_flag():
    parser = build_parser()
    for argv in (["generate", "x", "--expert-parallel-size", "2"], ["serve", "-ep", "2"]):
        config = EngineConfig.from_args(parser.parse_args(argv))
        assert config.expert_parallel_size == 2 and config.world_size == 2
    assert EngineConfig.from_args(parser.parse_args(["chat"])).expert_parallel_size == 1


@pytest.mark.gpu
def test_two_gpus_equal_one(moe_checkpoints, moe_prompts):
    """EP=2 over NCCL on two GPUs (eager steps: the exact exchange; the grouped kernels on each rank's
    experts): EP=1's tokens."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    path, _ = moe_checkpoints["qwen2_moe"]
    gpu = dict(COMMON, device="cuda")
    with LLM(str(path), **gpu) as llm:
        one = [o.token_ids for o in llm.generate(moe_prompts, GREEDY)]
    with LLM(str(path), **gpu, expert_parallel_size=2, cuda_graphs=False) as llm:
        assert llm.engine.runner.graphs is None
        assert not any(block.parallel.fixed_capacity for block in moe_blocks(llm.engine.model))
        assert [o.token_ids for o in llm.generate(moe_prompts, GREEDY)] == one


# ------------------------------------------------------------------------ the fixed-capacity exchange


def fixed_and_exact(size: int, experts: int, x, weights, ids, run_experts_of) -> tuple[list, list, list]:
    """The step through ExpertParallel on `size` thread ranks, fixed-capacity then exact: (fixed outputs,
    exact outputs, what each rank's all-to-alls received on the fixed path)."""
    def step(fixed):
        return lambda group: ExpertParallel(group, experts, fixed_capacity=fixed)(x, weights, ids, run_experts_of(group))
    fixed, groups = on_thread_ranks(size, step(True))
    exact, _ = on_thread_ranks(size, step(False))
    return fixed, exact, [group.received for group in groups]


@pytest.mark.parametrize("size,experts,top_k,tokens", [
    (2, 4, 2, 5),  # the lesson's shape, ragged slices (3 and 2 tokens)
    (3, 6, 2, 7),  # three ranks, slices of 3, 3 and 1
    (3, 6, 2, 2),  # the last rank has no token of its own
    (2, 8, 1, 1),  # a lone decode, top-1: rank 1 sends nothing real
    (4, 8, 2, 9),  # two experts a rank, top-2: a token may send both its pairs to one rank
])
def test_fixed_capacity_equals_the_exact_exchange_and_one_rank(size, experts, top_k, tokens):
    w13, w2 = expert_weights(experts, seed=tokens)
    g = torch.Generator().manual_seed(size * tokens)
    x = torch.randn(tokens, 16, generator=g)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=True)
    fixed, exact, received = fixed_and_exact(size, experts, x, weights, ids, lambda group: local_experts(group, w13, w2))
    expected = experts_loop(x, w13, w2, weights, ids)
    for a, b in zip(fixed, exact):
        torch.testing.assert_close(a, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    share, local = -(-tokens // size), experts // size
    capacity = share * min(top_k, local)
    for ids_in, rows_in, back in received:  # every rank: the same fixed sizes
        assert ids_in.shape == (size * capacity,) and rows_in.shape == back.shape == (size * capacity, 16)
    real = sum(int((r[0] < local).sum()) for r in received)
    assert real == tokens * top_k  # every pair reached its expert once; the rest was padding


def test_every_token_to_one_ranks_experts_fills_its_capacity():
    """The worst case the capacity is sized for: every token of every rank picks experts 0 and 1, both
    on rank 0. Rank 0 receives only real rows, rank 1 only padding (the id 2: none of its experts)."""
    w13, w2 = expert_weights(4, seed=3)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))
    weights = torch.tensor([[0.7, 0.3]]).repeat(6, 1)
    ids = torch.tensor([[0, 1], [1, 0]]).repeat(3, 1)
    fixed, exact, received = fixed_and_exact(2, 4, x, weights, ids, lambda group: local_experts(group, w13, w2))
    expected = experts_loop(x, w13, w2, weights, ids)
    for a, b in zip(fixed, exact):
        torch.testing.assert_close(a, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, expected, rtol=1e-5, atol=1e-5)
    assert sorted(received[0][0].tolist()) == [0] * 6 + [1] * 6  # 2 ranks x capacity 3 * 2, all real
    assert received[1][0].tolist() == [2] * 12


def dense_experts(group: ThreadGroup, w13, w2):
    """run_experts that reads no value on the host: every one of this rank's experts on every row, then
    each row's pick (the id past the last expert: zeros)."""
    per = w13.shape[0] // group.size
    w13, w2 = w13[group.rank * per:(group.rank + 1) * per], w2[group.rank * per:(group.rank + 1) * per]

    def run(rows, weights, ids):
        gate, up = torch.einsum("rh,eih->eri", rows, w13).split(w2.shape[2], dim=-1)  # [E, R, I] each
        out = torch.einsum("eri,ehi->erh", F.silu(gate) * up, w2)  # [E, R, H]
        out = torch.cat([out, out.new_zeros(1, *out.shape[1:])])  # expert E: none
        picked = out[ids, torch.arange(rows.shape[0])[:, None]]  # [R, k, H]
        return (picked * weights[..., None]).sum(dim=1)
    return run


def no_host_reads(monkeypatch):
    """Make every way a tensor's value reaches Python raise (what would stop a CUDA graph's capture)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor's value was read on the host")
    for name in ("tolist", "item", "nonzero", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_the_fixed_capacity_exchange_reads_no_value_and_its_sizes_follow_the_token_count(monkeypatch):
    """Three routings of 7 tokens over 3 ranks (spread, all to rank 0's experts, all to rank 2's): no
    tensor value is read on the host while they run, the all-to-alls' sizes are the same for all three,
    and each output is the loop's."""
    w13, w2 = expert_weights(6, seed=7)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 16, generator=g)
    routings = [route(torch.randn(7, 6, generator=g), 2, renormalize=True)[1],
                torch.tensor([[0, 1], [1, 0]] * 3 + [[0, 1]]), torch.tensor([[5, 4]] * 7)]
    weights = torch.rand(7, 2, generator=g)
    expected = [experts_loop(x, w13, w2, weights, ids) for ids in routings]
    runs = []
    with monkeypatch.context() as patch:
        no_host_reads(patch)
        for ids in routings:
            runs.append(on_thread_ranks(3, lambda group, ids=ids: ExpertParallel(group, 6, fixed_capacity=True)(
                x, weights, ids, dense_experts(group, w13, w2))))
    for (outs, _), loop in zip(runs, expected):
        for out in outs:
            torch.testing.assert_close(out, loop, rtol=1e-5, atol=1e-5)
    shapes = [[[tuple(r.shape) for r in group.received] for group in groups] for _, groups in runs]
    assert shapes[0] == shapes[1] == shapes[2] == [[(18,), (18, 16), (18, 16)]] * 3  # 3 ranks x 3 tokens x 2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the graph path's buffers on the CPU go "
                    "through the Triton backend: TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("family,fused", [pytest.param("qwen2_moe", False, marks=pytest.mark.slow),
                                          pytest.param("mixtral", True, marks=pytest.mark.slow)])
def test_gloo_ranks_on_the_graph_path_equal_one_and_hf(moe_checkpoints, moe_prompts, hf_greedy, family, fused):
    """cuda_graphs=True on the CPU: the graph path's static buffers and padding, no capture, and every
    MoE block on the fixed-capacity exchange; over two gloo ranks, HF's tokens (a lone sequence's
    decode steps too: one padded row, nothing real for rank 1 to send). Mixtral's experts run in the
    grouped kernels (the interpreter), which skip the padding rows."""
    path, hf = moe_checkpoints[family]
    prompts = moe_prompts
    if fused:  # shorter prompts: the interpreter runs every program of the grouped kernels in Python
        prompts = [moe_prompts[0][:16], moe_prompts[3][:12], moe_prompts[2]]
    graphs = dict(attention_backend="triton", cuda_graphs=True, fused_kernels=fused)
    one, load_one = run(path, prompts, **graphs)
    with LLM(str(path), **COMMON, **graphs, expert_parallel_size=2) as llm:
        assert llm.engine.runner.graphs is not None
        assert all(block.parallel.fixed_capacity for block in moe_blocks(llm.engine.model))
        two = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        two += [o.token_ids for o in llm.generate(prompts[2:3], GREEDY)]
        load_two = llm.engine.expert_load()
    assert two == one == [hf_greedy(hf, p, 6) for p in prompts + prompts[2:3]]
    assert load_two == load_one


@pytest.mark.gpu
def test_the_fixed_capacity_exchange_replays_in_a_cuda_graph():
    """One GPU, one rank (the all-to-alls hand the buffers back): the exchange and the grouped kernels
    captured once, then replayed on three routings of the same shape; each replay gives the loop's output."""
    from nanoserve.kernels.moe import fused_moe

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w13, w2 = (w.cuda() for w in expert_weights(8, seed=5))
    x = torch.randn(24, 16, device="cuda")
    weights, ids = route(torch.randn(24, 8, device="cuda"), 2, renormalize=True)
    parallel = ExpertParallel(Group(0, 1), 8, fixed_capacity=True)

    def step():
        return parallel(x, weights, ids, lambda rows, w, i: fused_moe(rows, w13, w2, w, i))
    step()  # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        new_weights, new_ids = route(torch.randn(24, 8, generator=g), 2, renormalize=True)
        weights.copy_(new_weights)
        ids.copy_(new_ids if seed != 1 else torch.tensor([[6, 7]] * 24))
        graph.replay()
        torch.testing.assert_close(out, experts_loop(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_two_gpus_with_cuda_graphs_equal_one(moe_checkpoints, moe_prompts):
    """EP=2 over NCCL on two GPUs with CUDA graphs (decode and mixed steps captured, the fixed-capacity
    exchange in every MoE block, async scheduling on): EP=1's tokens, in graphs too."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    for family in ("qwen2_moe", "mixtral"):
        path, _ = moe_checkpoints[family]
        gpu = dict(COMMON, device="cuda")
        with LLM(str(path), **gpu) as llm:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.capture
            one = [o.token_ids for o in llm.generate(moe_prompts, GREEDY)]
        with LLM(str(path), **gpu, expert_parallel_size=2) as llm:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.capture
            assert llm.engine.async_scheduling
            assert all(block.parallel.fixed_capacity for block in moe_blocks(llm.engine.model))
            assert [o.token_ids for o in llm.generate(moe_prompts, GREEDY)] == one
