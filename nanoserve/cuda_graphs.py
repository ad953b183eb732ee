"""Week 12: decode steps replayed from CUDA graphs, fed by a lean host side.

At batch 1 an eager decode step of Llama-3.2-1B launches about 535 kernels, and the host takes
far longer to issue them than the GPU takes to run them. A CUDA graph records the whole forward
pass once and replays it with a single launch. The price: a graph replays *exactly* what it
recorded, so every tensor it touches must live at a fixed address with a fixed shape:

- the inputs (token ids, positions, slot mapping, context lengths, block tables) live in
  preallocated device buffers; each step copies the new values into them;
- one graph per batch size in `CAPTURE_SIZES`; a batch is padded up to the next size, and the
  padding rows write their K/V into a scratch block that no sequence owns;
- the attention kernel's launch grid (its number of context splits) is fixed at capture time;
  the kernel cuts each sequence's own context into that many slices when it runs.
What is captured is `Llama.forward` itself, over the Triton paged context built on those
buffers (with the fused kernels behind its modules): the graph runs the very code an eager step
runs. Prefill steps, and batches larger than the largest size, run eagerly.

Once the GPU work is one replay, the host work around it is what is left, so the step's
`StepInput` is staged without per-step allocation: into pinned host mirrors of the buffers (the
copies are then asynchronous) with plain Python and NumPy, sent with one copy for the four
per-sequence inputs and one for the block tables. A block-table row is rewritten only when its
sequence or its number of blocks changed (once every `block_size` steps per sequence).

Without a GPU (`capture=False`), the same buffers feed an eager forward pass: the padding and
the bookkeeping behave identically, which is how the CPU tests check them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.blocks import blocks_needed
from nanoserve.cache import PagedAttentionMetadata, PagedContext, PagedKVCache
from nanoserve.model import Llama

if TYPE_CHECKING:
    from nanoserve.runner import StepInput

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def padded_size(n: int, sizes: tuple[int, ...] | list[int]) -> int:
    """The smallest captured batch size that holds n sequences."""
    # >>> week12: padded-size
    return next(s for s in sizes if s >= n)
    # <<< week12: padded-size


class CUDAGraphDecoder:
    """Captures one decode graph per batch size and replays it with fresh inputs."""

    def __init__(self, model: Llama, cache: PagedKVCache, scratch_block: int, max_model_len: int, max_batch: int,
                 context_class: type[PagedContext], fused: bool, capture: bool | None = None):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.context_class, self.fused = context_class, fused
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_batch] or [1]
        device = model.embed_tokens.weight.device
        self.capture = device.type == "cuda" if capture is None else capture
        n = self.sizes[-1]
        self.max_blocks = blocks_needed(max_model_len, cache.block_size)
        self.scratch_slot = scratch_block * cache.block_size
        # Device buffers at fixed addresses, read by the graphs. inputs: ids, positions, slots, context lengths.
        self.inputs = torch.zeros(4, n, dtype=torch.long, device=device)
        self.inputs[2] = self.scratch_slot
        self.inputs[3] = 1
        self.block_tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self.tables_staging = torch.empty(n * self.max_blocks, dtype=torch.int32, device=device)
        # Host mirrors. Pinned memory lets the copies run asynchronously.
        pin = device.type == "cuda"
        self.host_inputs = self.inputs.cpu().pin_memory() if pin else self.inputs.clone()
        self.host_tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.int32).numpy()
        self.host_compact = torch.empty(n * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.row_owner: list[tuple | None] = [None] * n  # which table each host row holds
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if self.capture:
            self._capture()

    def _forward(self, bs: int) -> torch.Tensor:
        """The model's forward pass for `bs` decode rows, reading every input from the buffers."""
        input_ids, positions, slots, context_lens = self.inputs[:, :bs]
        meta = PagedAttentionMetadata(slot_mapping=slots, query_start_loc=self.query_start_loc[: bs + 1],
                                      context_lens=context_lens, block_tables=self.block_tables[:bs],
                                      max_query_len=1, max_context_len=self.max_model_len)
        hidden = self.model(input_ids, positions, self.context_class(self.cache, meta, fused=self.fused))
        return self.model.compute_logits(hidden)

    @torch.no_grad()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # warm up: compiles kernels, moves lazily-placed tensors
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def stage(self, step: StepInput) -> int:
        """Copy one decode step's inputs into the static buffers; returns the padded batch size."""
        # >>> week12: stage-inputs
        n = step.num_seqs
        bs = padded_size(n, self.sizes)
        width = 1
        for i, (table, table_id) in enumerate(zip(step.block_tables, step.table_ids)):
            width = max(width, len(table))
            owner = (table_id, len(table))  # a table only grows, until its version changes
            if self.row_owner[i] != owner:  # another sequence, or a new block: rewrite the row
                self.host_tables[i, : len(table)] = table
                self.row_owner[i] = owner
        # Padding rows: token 0 at position 0, written to the scratch slot, context of 1. Their
        # block-table rows keep whatever they held: they only read one slot, and nobody uses it.
        pad = bs - n
        host = self.host_inputs.numpy()
        host[0, :bs] = step.input_ids + [0] * pad
        host[1, :bs] = step.positions + [0] * pad
        host[2, :bs] = step.slot_mapping + [self.scratch_slot] * pad
        host[3, :bs] = step.context_lens + [1] * pad
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        # The block tables: only the [bs, width] corner changes; pack it, send it, unpack on the GPU.
        compact = self.host_compact[: bs * width]
        compact.numpy().reshape(bs, width)[:] = self.host_tables[:bs, :width]
        staged = self.tables_staging[: bs * width]
        staged.copy_(compact, non_blocking=True)
        self.block_tables[:bs, :width].copy_(staged.view(bs, width))
        return bs
        # <<< week12: stage-inputs

    @torch.no_grad()
    def run(self, step: StepInput) -> torch.Tensor:
        """One decode step (one new token per sequence) -> logits [n, vocab]."""
        bs = self.stage(step)
        if not self.capture:
            return self._forward(bs)[: step.num_seqs]
        self.graphs[bs].replay()
        return self.logits[bs][: step.num_seqs]
