"""A CPU tier behind the prefix cache: blocks the GPU pool evicts are kept in host memory, found by
the same names, and copied back on a hit instead of being computed again (issue 35).

Week 14's cache forgets a block the moment the pool needs it for something else: the next prompt
that shares that prefix prefills it again. Host memory is much larger than the GPU's, and a copy
over PCIe is much cheaper than a forward pass. So there are two tiers of one cache:

    GPU tier   the paged pool itself (week 14's `PrefixCachingAllocator`): held, cached, free
    CPU tier   `num_slots` block-sized slots of (pinned) host memory: name -> slot, its own LRU

A name lives in at most one tier. Its way through them:

    GPU (cached, ref 0) --evicted by the pool--> CPU   (a copy GPU block -> CPU slot: an *offload*)
    CPU --hit by a lookup--------------------> GPU   (a GPU block allocated, a copy slot -> block: a *reload*;
                                                      it is then a normal cached block, named and held)
    CPU, least recently used, when the tier is full and another block comes in --> gone for good

The latency ladder (per token of Llama-3.2-1B in bf16: 16 layers x 8 KV heads x 64 x 2 (K, V) x 2
bytes = 32 KiB of K/V; nominal figures of an H100 SXM from its datasheet, arithmetic only, not
measured here):

    read from HBM          32 KiB at ~3.35 TB/s                       ~0.01 us   (a GPU hit)
    copy over PCIe 5 x16   32 KiB at ~50 GB/s (of 64 nominal)         ~0.7 us    (a CPU hit)
    recompute (prefill)    2 x 1.24 G params = 2.5 GFLOP at ~1 PFLOP/s ~2.5 us    (a miss), at full
                           use of the tensor cores, before attention, whose cost grows with the prefix

so a CPU hit is several times cheaper than a miss, and the gap widens with the prefix's length.

Why offload at eviction time, and not when a block is first cached: most cached blocks are hit
again on the GPU, or never; copying every one of them would spend PCIe bandwidth on blocks that
never need it. At eviction the block is about to be lost: that is the one moment a copy can save
work, and the LRU order already picked the coldest block. (vLLM's and SGLang's tiered caches make
the same choice: write back on eviction.)

Nothing here touches a tensor. The allocator only records the copies a step needs, and the
scheduler hands them to the runner with the batch (`Batch.offloads`, `Batch.reloads`, as
(GPU block, CPU slot) and (CPU slot, GPU block) pairs), in the order the runner must run them:

    1. every offload, in the order scheduled: each reads its block before anything overwrites it
       (this step's reload into it, or this step's forward pass, which may write new K/V there);
    2. then every reload: the slot it reads was filled by an earlier offload (this step's or an
       earlier step's, and the runner keeps steps in order), and no slot that a reload of this
       step reads is reused by an offload of the same step (freed slots wait in `released`
       until the copies are handed out);
    3. then the forward pass, which may read the reloaded blocks.

A block whose reload is still pending and is evicted again in the same step (a sequence matched it,
did not fit, and gave it back) has no content on the GPU yet: its name simply goes back to the slot
it came from, and the reload is cancelled. The copies of a step that schedules no sequence stay
pending and go out with the next batch, which is the first to read any block they concern.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from nanoserve.scheduler.prefix_cache import PrefixCachingAllocator, block_hash


class CPUTier:
    """The CPU tier's bookkeeping: `num_slots` slots, names -> slots in LRU order, and the copies
    scheduled since they were last handed out."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a CPU tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self.slot_of_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.released: list[int] = []  # slots a pending reload reads: free once the copies are handed out
        self.offloads: list[tuple[int, int]] = []  # (GPU block, CPU slot), pending
        self.reloads: list[tuple[int, int]] = []  # (CPU slot, GPU block), pending
        self.reloading: dict[int, int] = {}  # GPU block -> the slot its pending reload reads
        self.num_offloads = 0  # copies handed out, each way
        self.num_reloads = 0
        self.num_evictions = 0  # names dropped for good (the tier was full)

    def __contains__(self, name: bytes) -> bool:
        return name in self.slot_of_hash

    def __len__(self) -> int:
        return len(self.slot_of_hash)

    def store(self, name: bytes, block: int) -> None:
        """The GPU pool evicts `block`, named `name`: keep its content in a slot (an offload), the
        least recently used name of the tier dropped if none is free (or `name` itself, in the
        rare step whose reloads read every slot)."""
        # >>> week21: offload-evict
        if block in self.reloading:  # its content never reached the GPU: it is still in its slot
            slot = self.reloading.pop(block)
            self.reloads.remove((slot, block))
            self.released.remove(slot)
            self.slot_of_hash[name] = slot
            return
        if not self.free_slots and not self.slot_of_hash:  # every slot is read by a reload of this step
            self.num_evictions += 1  # nowhere to keep it: lost, as without a tier
            return
        if not self.free_slots:
            _, dropped = self.slot_of_hash.popitem(last=False)
            self.free_slots.append(dropped)
            self.num_evictions += 1
        slot = self.free_slots.popleft()
        self.slot_of_hash[name] = slot
        self.offloads.append((block, slot))
        # <<< week21: offload-evict

    def take(self, name: bytes) -> int:
        """A hit: `name` leaves the tier; returns its slot, which stays reserved for the reload
        (`reload_into`) until the step's copies are handed out."""
        slot = self.slot_of_hash.pop(name)
        self.released.append(slot)
        return slot

    def reload_into(self, slot: int, block: int) -> None:
        """Schedule the copy of `slot` (just taken) into GPU block `block`."""
        self.reloads.append((slot, block))
        self.reloading[block] = slot

    def discard(self, name: bytes) -> None:
        """The GPU has computed `name` again (a sequence that missed it prefilled it): the GPU copy
        is the one kept, so the name leaves the CPU tier and its slot is freed."""
        slot = self.slot_of_hash.pop(name, None)
        if slot is not None:
            self.released.append(slot)

    def hand_out(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies scheduled since the last call, (offloads, reloads), in the order to run
        them; the slots the reloads read are free again for later steps."""
        offloads, reloads = self.offloads, self.reloads
        self.offloads, self.reloads, self.reloading = [], [], {}
        self.free_slots.extend(self.released)
        self.released = []
        self.num_offloads += len(offloads)
        self.num_reloads += len(reloads)
        return offloads, reloads

    def check_invariants(self) -> None:
        """Every slot exactly once: free, released, or holding a name; pending reloads read
        released slots. An AssertionError names what breaks."""
        slots = list(self.free_slots) + self.released + list(self.slot_of_hash.values())
        assert len(slots) == len(set(slots)), "a CPU slot is in two places"
        assert set(slots) == set(range(self.num_slots)), "a CPU slot leaked"
        assert len(self.slot_of_hash) <= self.num_slots
        assert all(self.reloading[b] == s and s in self.released for s, b in self.reloads), "a reload's slot is reused"


class TieredPrefixAllocator(PrefixCachingAllocator):
    """Week 14's allocator with a CPU tier behind it: evictions move names to the CPU tier, and
    lookups continue there where the GPU misses. With the tier empty it behaves as week 14's."""

    def __init__(self, num_blocks: int, cpu_slots: int):
        super().__init__(num_blocks)
        self.cpu = CPUTier(cpu_slots)
        self.num_cpu_hit_tokens = 0  # of `num_hit_tokens`, those found in the CPU tier
        self.match_cpu_tokens = 0  # of the last `match`: tokens found in the CPU tier

    def evict(self) -> int:
        """Week 14's eviction, and the evicted name (with an offload of its content) into the CPU tier."""
        name = self.hash_of_block[next(iter(self.evictable))]
        block = super().evict()
        self.cpu.store(name, block)
        return block

    def match(self, names: list[bytes], num_blocks: int | None = None, token_ids: list[int] = (),
              block_size: int = 0) -> list[int]:
        """Week 14's `match` over both tiers: block by block, a name on the GPU is held once more;
        one in the CPU tier gets a GPU block (allocated now, so it may evict another) and a
        reload, and is named there. The chain stops at the first name in neither tier, or at a
        CPU hit when the pool has no block left to bring it back into. (Week 14's loop holds its
        hits after the walk; here each is held at once, so that the allocation of a later CPU hit
        cannot evict an earlier block of the same chain.)"""
        # >>> week21: tiered-match
        num_blocks = len(names) if num_blocks is None else num_blocks
        blocks, from_cpu = [], 0
        for i in range(num_blocks):
            if i == len(names):  # not named yet: chain it on its parent's name
                parent = names[-1] if i else None
                names.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))
            block = self.block_of_hash.get(names[i])
            if block is None:
                if names[i] not in self.cpu or not self.num_free:
                    break
                block = self.reload(names[i])
                from_cpu += 1
            elif self.ref_count[block] == 0:  # cached, held by nobody: held now, so no allocation evicts it
                del self.evictable[block]
                self.used.add(block)
                self.ref_count[block] = 1
            else:
                self.ref_count[block] += 1
            blocks.append(block)
        self.match_cpu_tokens = from_cpu * block_size
        return blocks
        # <<< week21: tiered-match

    def reload(self, name: bytes) -> int:
        """Bring `name` back from the CPU tier: a block allocated for it, named, a reload scheduled."""
        slot = self.cpu.take(name)  # first: the allocation may evict into a full tier, which must not drop `name`
        block = self.allocate()
        self.cpu.reload_into(slot, block)
        self.block_of_hash[name] = block
        self.hash_of_block[block] = name
        return block

    def register(self, block: int, h: bytes) -> None:
        """Week 14's naming of a filled block; a name the GPU now holds leaves the CPU tier."""
        super().register(block, h)
        if self.hash_of_block.get(block) == h:  # the GPU holds it now: one tier only
            self.cpu.discard(h)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        super().record_lookup(num_tokens, num_hit_tokens)
        self.num_cpu_hit_tokens += min(self.match_cpu_tokens, num_hit_tokens)
        self.match_cpu_tokens = 0

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies scheduled since the last call: (offloads, reloads), in the order to run them."""
        return self.cpu.hand_out()

    def stats(self) -> dict:
        s = super().stats()
        cpu = self.cpu
        return s | dict(gpu_hit_tokens=self.num_hit_tokens - self.num_cpu_hit_tokens,
                        cpu_hit_tokens=self.num_cpu_hit_tokens, offloads=cpu.num_offloads, reloads=cpu.num_reloads,
                        cpu_evictions=cpu.num_evictions, cpu_cached_blocks=len(cpu), cpu_blocks=cpu.num_slots)

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Week 14's invariants, the CPU tier's, and: no name in both tiers."""
        super().check_invariants(block_tables)
        self.cpu.check_invariants()
        both = [h for h in self.cpu.slot_of_hash if h in self.block_of_hash]
        assert not both, f"{len(both)} names are in both tiers"
