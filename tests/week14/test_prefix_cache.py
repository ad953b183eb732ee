"""Week 14: prefix caching. The block names, the allocator's three states, the scheduler reusing
cached prefixes (fake runner, randomized invariants after every step), and the engine's outputs
with caching equal to those without, with exactly the expected number of tokens saved."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.scheduler.blocks import OutOfBlocks
from nanoserve.engine.engine import LLM
from nanoserve.scheduler.prefix_cache import PrefixCachingAllocator, block_hash
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence
from nanoserve.testing import fitting_arrivals, make_checkpoint, run_scheduler, tiny_config

# ------------------------------------------------------------------------------ block names


def chain(tokens, block_size):
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@pytest.mark.exercise("match-prefix")
def test_equal_prefixes_have_equal_chains_and_one_token_changes_every_later_name():
    a = list(range(40))
    b = a[:17] + [999] + a[18:]  # differs in the 2nd token of block 2 (block size 8)
    ha, hb = chain(a, 8), chain(b, 8)
    assert ha == chain(list(range(40)), 8) and len(ha) == 5 and len(set(ha)) == 5
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))
    # the same tokens under another parent are another block
    assert block_hash(None, a[8:16]) != ha[1]
    assert all(isinstance(h, bytes) and len(h) == 16 for h in ha)


# ------------------------------------------------------------------------------ the allocator


def consistent_pool():
    """A pool of 6 in every state: block 0 held twice (named), 1 held once (named), 2 held once
    (no name: a partial last block), 3 cached (named, evictable), 4 and 5 free."""
    alloc = PrefixCachingAllocator(6)
    blocks = [alloc.allocate() for _ in range(4)]
    for block, name in zip((0, 1, 3), (b"A", b"B", b"D")):
        alloc.register(block, name * 16)
    alloc.free(3)
    assert alloc.match([b"A" * 16]) == [0]
    return alloc, [[0, 1, 2], [0]], blocks


def plant(alloc, kind):
    """Break one invariant of `consistent_pool`'s state, as a bug in the allocator would."""
    if kind == "free twice":
        alloc.free_blocks.append(4)
    elif kind == "free and held":
        alloc.ref_count[4] = 1
        alloc.used.add(4)
    elif kind == "count too low":
        alloc.ref_count[0] = 1
    elif kind == "count too high":
        alloc.ref_count[1] = 2
    elif kind == "held but not used":
        alloc.used.remove(2)
    elif kind == "used but cached":
        alloc.used.add(3)
    elif kind == "evictable without a name":
        del alloc.block_of_hash[alloc.hash_of_block.pop(3)]
    elif kind == "free with a name":
        alloc.hash_of_block[5] = b"F" * 16
        alloc.block_of_hash[b"F" * 16] = 5
    elif kind == "name points elsewhere":
        alloc.block_of_hash[b"A" * 16] = 1
    elif kind == "two names, one block":
        alloc.block_of_hash[b"Z" * 16] = 1
    elif kind == "lost on no list":
        alloc.free_blocks.remove(5)


PLANTED = ["free twice", "free and held", "count too low", "count too high", "held but not used",
           "used but cached", "evictable without a name", "free with a name", "name points elsewhere",
           "two names, one block", "lost on no list"]


@pytest.mark.exercise("invariants")
def test_invariants_hold_in_every_state_and_catch_each_planted_bug():
    alloc, tables, _ = consistent_pool()
    alloc.check_invariants(tables)  # all three states at once: nothing to report
    PrefixCachingAllocator(3).check_invariants([])  # a fresh pool
    for kind in PLANTED:
        alloc, tables, _ = consistent_pool()
        plant(alloc, kind)
        with pytest.raises(AssertionError):
            alloc.check_invariants(tables)
    alloc, tables, _ = consistent_pool()
    with pytest.raises(AssertionError):  # a table the allocator does not know about
        alloc.check_invariants(tables + [[1]])



@pytest.mark.exercise("release", "evict", "match-prefix")
def test_three_states_lru_eviction_and_double_free():
    alloc = PrefixCachingAllocator(4)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.register(a, b"A" * 16)
    alloc.register(b, b"B" * 16)
    alloc.check_invariants([[a, b]])
    alloc.free(b)  # tail first, as the scheduler frees a table
    alloc.free(a)
    assert alloc.num_free == 4 and list(alloc.evictable) == [b, a]
    alloc.check_invariants([])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    # a hit takes a cached block back from the evictable list
    assert alloc.match([b"A" * 16, b"B" * 16, b"C" * 16]) == [a, b]
    alloc.check_invariants([[a, b]])
    assert alloc.match([b"A" * 16]) == [a]  # shared: held by two tables
    alloc.check_invariants([[a, b], [a]])
    for block in (b, a, a):
        alloc.free(block)
    # plain free blocks go first; then the least recently used cached block is evicted
    got = [alloc.allocate() for _ in range(3)]
    assert set(got[:2]) == {2, 3} and got[2] == b and alloc.num_evictions == 1
    assert alloc.match([b"B" * 16]) == []  # its name went with it
    assert alloc.match([b"A" * 16]) == [a]
    with pytest.raises(OutOfBlocks):
        alloc.allocate()


@pytest.mark.exercise("match-prefix")
def test_match_names_the_chain_as_it_walks_and_stops_at_the_first_miss():
    """The lesson's worked example of `match-prefix`: blocks of 2, tokens 1..6."""
    tokens = [1, 2, 3, 4, 5, 6]
    h0, h1, h2 = chain(tokens, 2)
    alloc = PrefixCachingAllocator(4)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.register(a, h0)
    alloc.register(b, h1)
    alloc.free(b)
    alloc.free(a)
    names: list[bytes] = []
    assert alloc.match(names, 3, tokens, 2) == [a, b]
    assert names == [h0, h1, h2]  # block 2 named, then missed
    assert alloc.ref_count[a] == alloc.ref_count[b] == 1 and not alloc.evictable and alloc.used == {a, b}
    assert alloc.match(names, 1) == [a] and alloc.ref_count[a] == 2 and names == [h0, h1, h2]
    alloc.check_invariants([[a, b], [a]])
    other: list[bytes] = []
    assert alloc.match(other, 3, [9] + tokens[1:], 2) == [] and len(other) == 1  # nothing past the miss
    assert alloc.match([h0, h1, h2]) == [a, b]  # names already there: no tokens needed


def test_a_second_block_with_the_same_content_stays_private():
    alloc = PrefixCachingAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.register(a, b"X" * 16)
    alloc.register(b, b"X" * 16)  # prefilled in the same step as a: a keeps the name
    alloc.free(b)
    assert b in alloc.free_blocks and b not in alloc.evictable
    alloc.check_invariants([[a]])


# ------------------------------------------------------------------------------ the scheduler


def make_scheduler(num_blocks=64, block_size=4, **kw):
    return Scheduler(num_blocks, block_size, max_num_seqs=kw.pop("max_num_seqs", 8),
                     max_num_batched_tokens=kw.pop("budget", 256), max_model_len=256, prefix_caching=True, **kw)


def seq(tokens, max_tokens=3):
    return Sequence(list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens))


def check(s: Scheduler) -> None:
    s.allocator.check_invariants([q.block_table for q in s.running])
    assert all(not q.block_table for q in s.waiting), "a waiting sequence holds blocks"


@pytest.mark.exercise("reuse-prefix")
def test_a_shared_prefix_is_computed_once():
    s = make_scheduler()
    system = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
    first = seq(system + [1, 2, 3])
    run_scheduler(s, {0: [first]})
    second = seq(system + [7, 8])
    s.add(second)
    batch = s.schedule()
    assert batch.seqs == [second] and batch.num_new_tokens == [12 - 8]  # 2 cached blocks = 8 tokens
    assert second.num_computed == 8
    assert s.allocator.stats()["hit_tokens"] == 8


@pytest.mark.exercise("reuse-prefix")
def test_a_fully_cached_prompt_recomputes_its_last_block():
    """All of it cached, length a multiple of the block size: the last block is not reused (its
    last token must run to give logits, and a shared block is never written)."""
    s = make_scheduler()
    prompt = list(range(50, 62))  # 3 full blocks
    run_scheduler(s, {0: [seq(prompt)]})
    again = seq(prompt)
    s.add(again)
    batch = s.schedule()
    assert batch.num_new_tokens == [4] and again.num_computed == 8
    check(s)


@pytest.mark.exercise("reuse-prefix")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 3), st.integers(0, 9), st.integers(1, 12)),
                min_size=1, max_size=24),
       st.integers(8, 30), st.sampled_from([2, 4]), st.lists(st.integers(0, 40), max_size=4))
def test_random_runs_keep_the_invariants_after_every_step(requests, num_blocks, block_size, aborts):
    """Requests built from 4 shared prefixes, with arrivals, preemption (small pools), eviction
    and aborts: after every step each block is free, held or evictable (one of them), and its
    reference count equals the block tables that hold it."""
    rng = random.Random(len(requests) * 31 + num_blocks)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 14))] for _ in range(4)]
    s = Scheduler(num_blocks, block_size, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256,
                  prefix_caching=True)
    arrivals, seqs = fitting_arrivals(s, [
        (step, seq(prefixes[which] + [rng.randrange(1000) for _ in range(extra)] or [1], max_tokens=out))
        for step, which, extra, out in requests])

    def on_step(step, batch):
        check(s)
        for q, n in zip(batch.seqs, batch.num_new_tokens):
            assert len(q.block_table) * block_size >= q.num_computed + n
        if step in aborts and s.running:
            s.finish(s.running[step % len(s.running)], "abort")
            check(s)

    run_scheduler(s, arrivals, on_step=on_step)
    check(s)
    assert s.allocator.num_free == num_blocks
    assert all(len(q.output_ids) == q.params.max_tokens for q in seqs if q.finish_reason != "abort")


# ------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("w14") / "ckpt", tiny_config(num_hidden_layers=2))


def tokens(n, seed):
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run_waves(path, waves, caching, **kw):
    """Generate each wave of prompts after the previous one finished -> (token ids, engine)."""
    args = dict(dtype=torch.float32, device="cpu", block_size=4, num_blocks=128, enable_prefix_caching=caching)
    llm = LLM(str(path), **(args | kw))
    outs = [o.token_ids for wave in waves for o in llm.generate(wave, GREEDY)]
    return outs, llm.engine


@pytest.mark.exercise("reuse-prefix")
def test_shared_system_prompts_same_tokens_and_exactly_the_saved_prefill(ckpt):
    path, _ = ckpt
    systems = [tokens(23, 1), tokens(9, 2)]
    waves = [[systems[0] + tokens(3, 3)], [systems[0] + tokens(n, 10 + n) for n in (1, 5, 8)] + [systems[1] + [5, 6]],
             [systems[1] + tokens(4, 30)]]
    off, eng_off = run_waves(path, waves, caching=False)
    on, eng_on = run_waves(path, waves, caching=True)
    assert on == off
    # system 0: 23 tokens = 5 full blocks of 4, hit by the 3 prompts of wave 2; system 1 (9
    # tokens, 2 blocks) is first seen in wave 2 and hit in wave 3.
    saved = 3 * 20 + 8
    assert eng_off.scheduler.num_scheduled_tokens - eng_on.scheduler.num_scheduled_tokens == saved
    stats = eng_on.prefix_cache_stats()
    assert stats["hit_tokens"] == saved and stats["lookups"] == 6 and eng_off.prefix_cache_stats() is None
    assert eng_on.scheduler.allocator.num_used == 0


@pytest.mark.exercise("reuse-prefix")
def test_multi_turn_chat_reuses_the_history(ckpt):
    """Each turn resends the whole conversation, the model's answers included."""
    path, _ = ckpt
    results = {}
    for caching in (False, True):
        llm = LLM(str(path), dtype=torch.float32, device="cpu", block_size=4, num_blocks=128,
                  enable_prefix_caching=caching)
        history, answers = [], []
        for turn in range(4):
            history = history + tokens(5 + turn, 40 + turn)  # the user's message
            answer = llm.generate([history], GREEDY)[0].token_ids
            answers.append(answer)
            history = history + answer
        results[caching] = (answers, llm.engine.scheduler.num_scheduled_tokens, llm.engine.prefix_cache_stats())
    assert results[True][0] == results[False][0]
    stats = results[True][2]
    assert stats["hit_tokens"] > 0 and results[True][1] == results[False][1] - stats["hit_tokens"]


def test_whole_prompt_cached_and_prompts_differing_in_a_blocks_last_token(ckpt):
    path, _ = ckpt
    p = tokens(16, 5)  # exactly 4 blocks
    q = tokens(18, 6)
    near = p[:11] + [p[11] + 1] + p[12:]  # differs in the last token of block 2
    waves = [[p, q], [p, q, near]]
    off, _ = run_waves(path, waves, caching=False)
    on, eng = run_waves(path, waves, caching=True)
    assert on == off and on[0] == on[2] and on[1] == on[3]
    # p: 3 blocks reused (not the 4th: its last token must run); q: 4 of its 4 full blocks
    # (18 tokens: 4 full + 2); near: blocks 0 and 1 only.
    assert eng.prefix_cache_stats()["hit_tokens"] == 12 + 16 + 8


def test_under_preemption_and_eviction_in_a_tiny_pool(ckpt):
    """A pool of 14 blocks of 4 for 6 prompts sharing 12 tokens: sequences are preempted (and hit
    their own cached blocks when they come back), cached blocks are evicted; tokens unchanged."""
    path, _ = ckpt
    shared = tokens(12, 7)
    prompts = [shared + tokens(3 + i, 50 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(str(path), dtype=torch.float32, device="cpu", block_size=4, num_blocks=14, max_num_seqs=6,
                  enable_prefix_caching=caching)
        outs[caching] = [o.token_ids for o in llm.generate(prompts, params)]
        outs[caching] += [o.token_ids for o in llm.generate([tokens(30, 99)], params)]  # forces evictions
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.allocator.num_used == 0
    assert outs[True] == outs[False]
    assert llm.engine.prefix_cache_stats()["evictions"] > 0


@pytest.mark.slow
def test_with_the_triton_backend_over_cached_blocks(ckpt):
    """The suffix's queries attend to the cached prefix through the paged kernel (Triton's
    interpreter on the CPU), with the fused kernels on: the same tokens as HF."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package: pip install triton (Linux)")
    path, hf = ckpt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    system = tokens(10, 8)
    prompts = [system + tokens(2, 81), system + tokens(7, 82)]
    llm = LLM(str(path), dtype=torch.float32, device=device, attention_backend="triton", block_size=4, num_blocks=64,
              enable_prefix_caching=True, fused_kernels=True, cuda_graphs=False)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert llm.engine.prefix_cache_stats()["hit_tokens"] == 8
    hf = hf.to(device)
    for prompt, got in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=6, min_new_tokens=6,
                               do_sample=False)[0, len(prompt):].tolist()
        assert got == expected
