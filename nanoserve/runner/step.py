"""StepInput: one step's tensors in host form, the same for eager runs, CUDA graphs and the
tensor-parallel workers (it is what the driver broadcasts)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepInput:
    """One step of the model, as plain data."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    table_ids: list[tuple[int, int]]  # per sequence: equal ids mean the table only grew since
    sample_rows: list[int]
    # Async scheduling: (row of input_ids, row of the previous step's sampled tokens) for each input token
    # the host has not seen yet: it is read on the device, from the tokens the last step sampled.
    from_last: list[tuple[int, int]] = field(default_factory=list)
    # The CPU tier (nanoserve/attention/cpu_pool.py): copies every rank runs before the forward
    # pass, offloads (GPU block, CPU slot) first, then reloads (CPU slot, GPU block).
    offloads: list[tuple[int, int]] = field(default_factory=list)
    reloads: list[tuple[int, int]] = field(default_factory=list)
    # Week 23: the adapter slot of each input token (-1: the base model); empty when no token has one.
    lora_slots: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampled: the shape CUDA graphs are captured for."""
        return len(self.input_ids) == self.num_seqs == len(self.sample_rows)

