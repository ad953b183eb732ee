"""Week 23: the adapter pool. Every registered adapter is kept in host memory; `max_loras` of them
are resident on the device, in the slots of the LoRA layers' buffers (`nanoserve/model/lora.py`).

A step's adapters are made resident before it runs: one already in a slot is just marked as
used last; another is copied into a free slot, or into the slot of the least recently used
adapter that no running request holds (evicting it costs nothing: its host copy stays). A slot
whose adapter a running request holds is never taken; the scheduler admits no more distinct
adapters than there are slots, so a step always finds room, and the pool says so loudly if not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from nanoserve.model.lora import Adapter, LoRALinear, LoRAState


class AdapterPool:
    """Adapters by id (0: none): all on the host, up to `max_loras` in device slots, LRU."""

    def __init__(self, state: LoRAState, layers: dict[tuple[int, str], LoRALinear]):
        self.state, self.layers = state, layers
        self.max_loras = max_loras = state.max_loras
        self.adapters: dict[int, Adapter] = {}  # every registered adapter, on the host
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.free_slots = list(range(max_loras - 1, -1, -1))  # pop() takes slot 0 first
        # The adapter ids running requests hold: asked when a slot must be freed (the engine hands the
        # scheduler's `adapters_in_use`; the runner knows no sequences).
        self.running: Callable[[], set[int]] = set
        self.num_loads = 0
        self.num_evictions = 0

    def add(self, lora_id: int, adapter: Adapter) -> None:
        """Keep an adapter on the host, in the slots' dtype (and in pinned memory beside a GPU, so that
        loading it into a slot is an asynchronous copy)."""
        a = next(iter(self.layers.values())).lora_a
        for pieces in adapter.pieces.values():
            for p in pieces:
                p.a, p.b = (t.to(a.dtype).pin_memory() if a.is_cuda else t.to(a.dtype) for t in (p.a, p.b))
        self.adapters[lora_id] = adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (the engine refuses while requests use it); its slot becomes free."""
        if lora_id in self.running():
            raise ValueError(f"adapter {self.adapters[lora_id].name!r} is in use by running requests")
        del self.adapters[lora_id]
        slot = self.resident.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def slots(self, lora_ids: list[int]) -> list[int]:
        """The slot of each adapter id (-1 for 0, no adapter), loading the ones not resident."""
        for lora_id in dict.fromkeys(i for i in lora_ids if i):  # each distinct adapter once, in order
            self.make_resident(lora_id, step=set(lora_ids))
        return [self.resident[i] if i else -1 for i in lora_ids]

    def make_resident(self, lora_id: int, step: set[int]) -> int:
        """The slot of `lora_id`, loaded if it is not resident; never one of the adapters of this step
        (`step`) or of a running request."""
        # >>> week23: adapter-pool
        if lora_id in self.resident:
            self.resident.move_to_end(lora_id)
            return self.resident[lora_id]
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            pinned = step | self.running()
            victim = next((i for i in self.resident if i not in pinned), None)
            if victim is None:
                raise RuntimeError(f"all {self.max_loras} adapter slots are held by running requests; the scheduler "
                                   "should have kept this request waiting (raise --max-loras to run more at once)")
            slot = self.resident.pop(victim)
            self.num_evictions += 1
        adapter = self.adapters[lora_id]
        for key, layer in self.layers.items():
            layer.set_slot(slot, adapter.pieces.get(key, []))
        self.resident[lora_id] = slot
        self.num_loads += 1
        return slot
        # <<< week23: adapter-pool
