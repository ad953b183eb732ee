"""Issue 38: held KV. A request with `hold_kv` keeps its blocks when it ends; a later request with
`resume_from` starts from them and prefills only what differs (nanoserve/scheduler/held.py)."""

import asyncio
import random

import pytest
import torch

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import check_block_invariants, make_checkpoint, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("held-kv"), tiny_config(), seed=3)
    return str(path)


def engine_of(ckpt: str, **kw) -> Engine:
    args = dict(model=ckpt, dtype=torch.float32, device="cpu", block_size=4, num_blocks=64, max_model_len=256)
    return Engine(EngineConfig(**(args | kw)))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def run(engine: Engine, prompt: list[int], params=GREEDY, **kw):
    """Run one request to its end; its final output."""
    rid = engine.add_request(prompt, params, stream=False, **kw)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


def fresh(ckpt: str, prompt: list[int]) -> list[int]:
    return run(engine_of(ckpt, enable_prefix_caching=False), prompt).token_ids


def assert_no_leak(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    assert engine.held_kv()["blocks"] == 0 and not engine.scheduler.held.entries
    assert alloc.num_free == alloc.num_blocks and alloc.num_used == 0
    check_block_invariants(engine.scheduler)


@pytest.mark.parametrize("caching,chunked", [(False, False), (True, False), (True, True), (False, True)])
def test_resume_shapes_give_the_tokens_of_a_fresh_run(ckpt, caching, chunked):
    """Append a suffix; diverge inside a block; resend the held tokens exactly. Each resumed run's
    tokens equal a fresh run of the whole prompt, and only the prompt past the reused prefix runs."""
    kw = dict(enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    if chunked:
        kw.update(max_num_batched_tokens=8, max_num_seqs=4)  # the suffix goes through in chunks
    engine = engine_of(ckpt, **kw)
    prompt = tokens(10, 1)
    first = run(engine, prompt, hold_kv=True)
    held = prompt + first.token_ids[:-1]  # 15 tokens: the last sampled one never ran
    assert first.num_held_blocks == 4 and engine.held_kv()["blocks"] == 4
    diverged = held[:9] + [held[9] + 1] + tokens(6, 2)  # differs in block 2 (tokens 8..11), a full block
    cases = [
        (prompt + first.token_ids + tokens(7, 3), 15),  # a suffix: all held tokens reused
        (diverged, 8 if caching else 9),  # a named (full, cached) block is never written: dropped, recomputed
        (held, 14),  # the held tokens exactly: the last one runs again, for logits
    ]
    rid = first.request_id
    for new_prompt, reused in cases:
        before = engine.scheduler.num_scheduled_tokens
        out = run(engine, new_prompt, resume_from=rid, hold_kv=True)
        assert out.resume_outcome == "resumed" and out.num_resumed_tokens == reused
        assert out.num_cached_tokens >= reused
        assert engine.scheduler.num_scheduled_tokens - before == len(new_prompt) - out.num_cached_tokens + 5
        assert out.token_ids == fresh(ckpt, new_prompt)
        assert out.num_held_blocks > 0 and engine.release_held(out.request_id)  # held again, as a session's turn
        rid = run(engine, held, hold_kv=True).request_id  # the next case resumes from the same held tokens
    assert engine.release_held(rid)
    assert not engine.release_held(rid)  # already gone
    assert_no_leak(engine)


def test_a_resume_whose_entry_is_gone_prefills_from_scratch(ckpt):
    engine = engine_of(ckpt)
    prompt = tokens(9, 4)
    first = run(engine, prompt, hold_kv=True)
    assert engine.release_held(first.request_id)
    out = run(engine, prompt + first.token_ids, resume_from=first.request_id)
    assert out.resume_outcome == "evicted" and out.num_resumed_tokens == 0
    assert out.token_ids == fresh(ckpt, prompt + first.token_ids)
    never = run(engine, prompt, resume_from=12345)
    assert never.resume_outcome == "evicted"
    other = run(engine, tokens(9, 5), hold_kv=True)  # nothing in common with the next prompt
    miss = run(engine, tokens(9, 6), resume_from=other.request_id)
    assert miss.resume_outcome == "mismatch" and miss.num_resumed_tokens == 0
    assert_no_leak(engine)


def test_abort_with_hold_kv_frees_and_so_does_aborting_a_waiting_resume(ckpt):
    engine = engine_of(ckpt)
    rid = engine.add_request(tokens(9, 7), GREEDY, hold_kv=True)
    engine.step()
    engine.abort(rid)
    assert_no_leak(engine)
    first = run(engine, tokens(9, 8), hold_kv=True)
    rid = engine.add_request(tokens(9, 8) + first.token_ids, GREEDY, resume_from=first.request_id)
    assert engine.held_kv()["blocks"] == 4  # the resume's blocks wait with it in the queue
    engine.abort(rid)
    assert_no_leak(engine)


@pytest.mark.parametrize("caching", [False, True])
def test_memory_pressure_evicts_held_kv_before_preempting(ckpt, caching):
    """16 blocks of 4; two held entries of 4 blocks; then requests that need most of the pool: the
    entries go (least recently held first), nobody is preempted; a resume from an evicted entry
    prefills again and gets the right tokens."""
    engine = engine_of(ckpt, num_blocks=16, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = run(engine, tokens(10, 10), params, hold_kv=True)
    b = run(engine, tokens(10, 11), params, hold_kv=True)
    assert engine.held_kv()["blocks"] == 8
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    big = [engine.add_request(tokens(12, 20 + i), long) for i in range(2)]  # 2 x 8 blocks at their end
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions == 0
    stats = engine.held_kv()
    assert stats["evictions"] == 2 and stats["entries"] == 0
    assert big and not engine.release_held(a.request_id) and not engine.release_held(b.request_id)
    again = run(engine, tokens(10, 10) + a.token_ids, params, resume_from=a.request_id)
    assert again.resume_outcome == "evicted"
    assert again.token_ids == fresh(ckpt, tokens(10, 10) + a.token_ids)
    assert_no_leak(engine)


def test_a_preempted_resumed_request_recomputes_and_keeps_its_tokens(ckpt):
    """A pool too small for everyone: the resumed request (admitted last, so the newest) is preempted
    and recomputed from scratch; its tokens still equal a fresh run."""
    engine = engine_of(ckpt, num_blocks=12, enable_prefix_caching=False)
    prompt = tokens(10, 30)
    first = run(engine, prompt, hold_kv=True)
    long = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    others = [engine.add_request(tokens(6, 31 + i), long) for i in range(2)]
    engine.step()  # the others run first
    new_prompt = prompt + first.token_ids + tokens(3, 33)
    rid = engine.add_request(new_prompt, long, stream=False, resume_from=first.request_id)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert others and engine.scheduler.num_preemptions > 0
    assert final.resume_outcome == "resumed" and final.num_resumed_tokens == 15
    assert final.token_ids == run(engine_of(ckpt, enable_prefix_caching=False), new_prompt, long).token_ids
    assert_no_leak(engine)


def test_async_engine_holds_resumes_and_releases_on_its_thread(ckpt):
    engine = AsyncEngine(engine_of(ckpt)).start()

    async def last(prompt, **kw):
        out = None
        async for out in engine.generate(prompt, GREEDY, **kw):
            pass
        return out

    async def main():
        prompt = tokens(10, 40)
        first = await last(prompt, hold_kv=True)
        second = await last(prompt + first.token_ids + tokens(4, 41), hold_kv=True, resume_from=first.request_id)
        assert second.num_resumed_tokens == 15 and second.num_held_blocks > 0
        assert engine.stats()["held_kv"]["entries"] == 1
        assert await engine.release_held(second.request_id)
        assert not await engine.release_held(second.request_id)
        return second

    try:
        second = asyncio.run(main())
        assert second.token_ids == fresh(ckpt, second.prompt_token_ids)
        assert engine.held_kv()["blocks"] == 0
    finally:
        engine.shutdown()


def test_static_batching_takes_the_entry_and_prefills_in_full(ckpt):
    engine = engine_of(ckpt, batching="static", enable_prefix_caching=False)
    prompt = tokens(9, 50)
    first = run(engine, prompt, hold_kv=True)
    out = run(engine, prompt + first.token_ids, resume_from=first.request_id)
    assert out.resume_outcome == "mismatch" and out.num_resumed_tokens == 0
    assert out.token_ids == fresh(ckpt, prompt + first.token_ids)
    assert_no_leak(engine)
