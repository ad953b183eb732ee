"""Week 23: the adapter pool (slots on the device, LRU to host memory, a slot in use never taken),
the scheduler's wait for a slot, adapters loaded and unloaded while requests run, and the prefix
cache, which never shares a block across adapters."""

import pytest

from lora_helpers import hf_greedy
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.model.llama import Llama
from nanoserve.model.lora import enable_lora, read_adapter
from nanoserve.runner.lora import AdapterPool
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.prefix_cache import block_hash
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence

LONG = [1] + list(range(100, 140))  # 41 tokens: two full blocks of 16, and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def pool(tiny, adapters):
    config = ModelConfig.from_json(tiny[0])
    pool = AdapterPool(*enable_lora(Llama(config), max_loras=2, max_rank=16))
    for i, name in enumerate(["attn8", "mlp4", "qv2"], start=1):
        pool.add(i, read_adapter(adapters[name], name, config, max_rank=16))
    return pool


@pytest.mark.exercise("adapter-pool")
def test_the_pool_evicts_the_least_recently_used(pool):
    assert pool.slots([1, 0, 2]) == [0, -1, 1]  # loaded into the free slots; 0 is the base model
    assert pool.slots([1]) == [0]  # resident: no load; 1 is now the most recently used
    assert pool.slots([3]) == [1]  # 2 was least recently used: its slot goes to 3
    assert (pool.num_loads, pool.num_evictions) == (3, 1) and list(pool.resident) == [1, 3]
    layer = pool.layers[0, "qkv_proj"]
    assert layer.lora_a[1].abs().sum() > 0  # 3's pieces written over 2's
    assert pool.slots([2]) == [0]  # back from host memory, into 1's slot (1 is older than 3)


@pytest.mark.exercise("adapter-pool")
def test_a_slot_in_use_is_never_taken(pool):
    pool.slots([1, 2])
    pool.running = lambda: {1, 2}  # running requests hold both slots
    with pytest.raises(RuntimeError, match="all 2 adapter slots are held by running requests"):
        pool.slots([3])
    pool.running = lambda: {2}
    assert pool.slots([3]) == [0]  # 1's slot: 1 is not running any more
    with pytest.raises(ValueError, match="in use by running requests"):
        pool.remove(2)
    pool.running = set
    pool.remove(2)
    assert pool.free_slots == [1] and 2 not in pool.adapters


@pytest.mark.exercise("hold-back")
def test_the_scheduler_keeps_a_request_waiting_for_a_slot():
    s = Scheduler(num_blocks=64, block_size=16, max_loras=1)
    first, second, base, third = (Sequence([1, 2, 3], SamplingParams(max_tokens=3), lora_id=i) for i in (1, 2, 0, 1))
    for seq in (first, second, base, third):
        s.add(seq)
    batch = s.schedule()
    # The second adapter finds no slot: it waits, and FCFS keeps those behind it waiting too.
    assert batch.seqs == [first] and list(s.waiting) == [second, base, third] and s.num_held_for_adapters == 1
    s.update(batch, [[7]])
    s.finish(first, "abort")
    batch = s.schedule()
    assert batch.seqs == [second, base] and list(s.waiting) == [third]  # adapter 1 waits for adapter 2 now
    assert s.adapters_in_use() == {2}


def test_prefix_caching_never_shares_blocks_across_adapters(tiny, adapters):
    """The same prompt under the base model, two adapters, then each again: blocks are reused only
    under the same adapter, and every answer is the one the model gives without caching."""
    modules = {k: str(v) for k, v in adapters.items()}
    cached = LLM(str(tiny[0]), device="cpu", lora_modules=modules, enable_prefix_caching=True)
    plain = LLM(str(tiny[0]), device="cpu", lora_modules=modules, enable_prefix_caching=False)
    order = [None, "attn8", "mlp4", None, "attn8", "mlp4"]
    hits = []
    for name in order:
        before = cached.engine.prefix_cache_stats()["hit_tokens"]
        out = cached.generate(LONG, GREEDY, lora=name)[0].token_ids
        hits.append(cached.engine.prefix_cache_stats()["hit_tokens"] - before)
        assert out == plain.generate(LONG, GREEDY, lora=name)[0].token_ids
    assert hits == [0, 0, 0, 32, 32, 32]  # the two full blocks, found only under their own adapter
    assert len({cached.generate(LONG, GREEDY, lora=n)[0].token_ids[0] for n in ("attn8", "mlp4", None)}) > 1


@pytest.mark.exercise("adapter-key")
def test_an_adapters_blocks_are_named_from_its_own_seed():
    """Under adapter i the first full block's name is block_hash(b"lora:i", its tokens), given at
    arrival; every later name chains on it as in week 14. So the same prompt gets the same names
    under the same adapter, and names that share nothing under another adapter or the base model."""
    prompt = list(range(10, 19))  # two full blocks of 4, and one token
    under, again, other, base = (Sequence(prompt, SamplingParams(max_tokens=4), lora_id=i) for i in (1, 1, 2, 0))
    s = Scheduler(num_blocks=64, block_size=4, prefix_caching=True)
    for seq in (under, again, other, base):
        s.add(seq)
    assert under.block_hashes == [block_hash(b"lora:1", prompt[:4])]  # named at arrival
    while s.has_unfinished():
        batch = s.schedule()
        s.update(batch, [[7]] * len(batch.seqs))
    assert len(under.block_hashes) == 3  # 9 prompt tokens + 4 new, 12 of them computed: three full blocks
    assert under.block_hashes[1] == block_hash(under.block_hashes[0], prompt[4:8])
    assert under.block_hashes == again.block_hashes
    for seq in (other, base):
        assert not set(seq.block_hashes) & set(under.block_hashes)
    assert base.block_hashes[0] == block_hash(None, prompt[:4])  # week 14's chain, unchanged


@pytest.mark.exercise("adapter-key")
def test_a_short_prompt_names_its_first_block_under_its_adapter():
    """A prompt shorter than a block fills its first block while decoding: the name it gets then has
    the adapter in it too."""
    s = Scheduler(num_blocks=64, block_size=4, prefix_caching=True)
    under, base = Sequence([5, 6], SamplingParams(max_tokens=4), lora_id=1), Sequence([5, 6], SamplingParams(max_tokens=4))
    for seq in (under, base):
        s.add(seq)
    for _ in range(3):
        batch = s.schedule()
        s.update(batch, [[7]] * len(batch.seqs))
    assert under.block_hashes and base.block_hashes and under.block_hashes[0] != base.block_hashes[0]


def test_adapters_load_and_unload_while_requests_run(tiny, adapters):
    _, hf = tiny
    llm = LLM(str(tiny[0]), device="cpu", max_loras=2, lora_modules={"attn8": str(adapters["attn8"])})
    engine = llm.engine
    running = engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora="attn8")
    outputs = {}

    def steps(n):
        for _ in range(n):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.token_ids

    steps(3)
    llm.add_lora("mlp4", adapters["mlp4"])  # mid-run: the next request may use it at once
    late = engine.add_request(LONG[:20], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora="mlp4")
    with pytest.raises(ValueError, match="adapter 'attn8' is in use by 1 request"):
        llm.remove_lora("attn8")
    steps(2)
    with pytest.raises(ValueError, match="in use"):
        llm.remove_lora("mlp4")
    while engine.has_unfinished():
        steps(1)
    assert outputs[running] == hf_greedy(hf, adapters["attn8"], LONG, 12)
    assert outputs[late] == hf_greedy(hf, adapters["mlp4"], LONG[:20], 6)
    llm.remove_lora("attn8")
    with pytest.raises(ValueError, match="unknown adapter 'attn8'; loaded: mlp4"):
        llm.generate(LONG, GREEDY, lora="attn8")
    llm.add_lora("attn8", adapters["qv2"])  # the name again, for other weights: a new id, no stale cache
    assert llm.generate(LONG, GREEDY, lora="attn8")[0].token_ids == hf_greedy(hf, adapters["qv2"], LONG, 6)
