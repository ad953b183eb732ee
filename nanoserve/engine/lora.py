"""Week 23: the LoRA adapters an engine serves, by name.

An adapter is read and checked against the model (`nanoserve.model.lora.read_adapter`), given an
id, and handed to the runner's pool (`nanoserve.runner.lora.AdapterPool`), which keeps it in host
memory and puts it in a device slot when a request first uses it. Ids are never reused: an adapter
unloaded and loaded again under the same name is a new one, so the prefix cache, whose block names
are seeded by the id, never finds the old one's blocks for it.
"""

from __future__ import annotations

import itertools
import os

from nanoserve.model.config import ModelConfig
from nanoserve.model.lora import Adapter, read_adapter
from nanoserve.runner.lora import AdapterPool
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Sequence


class LoRARegistry:
    """Adapter names -> ids (0: the base model), over the runner's pool (None: the engine has no LoRA
    layers). `sequences`: the engine's requests, by id (an adapter they use is not unloaded)."""

    def __init__(self, pool: AdapterPool | None, config: ModelConfig, max_rank: int | None, base_model: str,
                 scheduler: Scheduler, sequences: dict[int, Sequence]):
        self.pool, self.config, self.max_rank, self.base_model = pool, config, max_rank, base_model
        self.scheduler, self.sequences = scheduler, sequences
        if pool is not None:  # the slots of running requests' adapters are never taken
            pool.running = scheduler.adapters_in_use
        self.ids: dict[str, int] = {}
        self._next_id = itertools.count(1)

    def id_of(self, name: str | None) -> int:
        """The id of a loaded adapter (0 for None); a ValueError names the ones there are."""
        if name is None:
            return 0
        if name not in self.ids:
            known = ", ".join(self.ids) or "none"
            off = "" if self.pool is not None else " (start the engine with --lora-modules or --max-loras)"
            raise ValueError(f"unknown adapter {name!r}; loaded: {known}{off}")
        return self.ids[name]

    def read(self, name: str, path: str | os.PathLike) -> Adapter:
        """Read a PEFT LoRA adapter and check it and its name (a ValueError says why not). Changes
        nothing: the server runs it off the engine thread, then `add` on it."""
        if self.pool is None:
            raise ValueError("this engine has no LoRA layers: start it with --lora-modules or --max-loras")
        if not name or name == self.base_model or name in self.ids:
            raise ValueError(f"adapter name {name!r} is {'taken' if name else 'empty'}: pick another")
        return read_adapter(path, name, self.config, self.max_rank, base_model=self.base_model)

    def add(self, name: str, adapter: str | os.PathLike | Adapter) -> None:
        """Load an adapter (a PEFT folder, or what `read` returned) under `name`."""
        if not isinstance(adapter, Adapter) or name in self.ids:  # (a name may have been taken meanwhile)
            adapter = self.read(name, adapter.path if isinstance(adapter, Adapter) else adapter)
        lora_id = next(self._next_id)
        self.pool.add(lora_id, adapter)
        self.ids[name] = lora_id

    def remove(self, name: str) -> None:
        """Unload an adapter; refused (ValueError) while requests in the engine use it."""
        lora_id = self.id_of(name)
        users = sum(seq.lora_id == lora_id for seq in self.sequences.values())
        if users:
            raise ValueError(f"adapter {name!r} is in use by {users} request(s); unload it once they finish")
        self.pool.remove(lora_id)
        del self.ids[name]

    def stats(self) -> dict | None:
        """Adapters loaded and resident, slots, loads into a slot, evictions, and the steps in which a
        request waited for a slot; None without LoRA."""
        if self.pool is None:
            return None
        return dict(loaded=len(self.ids), resident=len(self.pool.resident), slots=self.pool.max_loras,
                    loads=self.pool.num_loads, evictions=self.pool.num_evictions,
                    steps_held=self.scheduler.num_held_for_adapters)
