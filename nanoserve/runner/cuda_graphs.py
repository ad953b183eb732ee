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

Week 17 adds verification steps of speculative decoding: every sequence runs q = 1 + k tokens
(its last token and k guesses) and samples all q rows. With `verify_tokens` > 0, one more graph
is captured per q in 2 .. verify_tokens + 1 and batch size up to `verify_batch`, over buffers of
their own (q tokens per sequence, `query_start_loc` = 0, q, 2q, ...). A verification step whose
sequences all have the same number of guesses replays one; others run eagerly.

Week 15's mixed steps (with chunked prefill: the decodes and a prompt chunk, up to the token
budget) get graphs too, with `mixed_tokens` > 0: one per token count in `MIXED_SIZES` up to the
budget. A step is padded up to the next count: its sequences first, then one padding sequence
holding the spare tokens (written to the scratch slot), then empty ones up to a fixed number of
sequences. Only the sampled rows go through the LM head, gathered by an index buffer.

Once the GPU work is one replay, the host work around it is what is left, so the step's
`StepInput` is staged without per-step allocation: into pinned host mirrors of the buffers (the
copies are then asynchronous) with plain Python and NumPy, sent with one copy for the four
per-sequence inputs and one for the block tables. A block-table row is rewritten only when its
sequence or its number of blocks changed (once every `block_size` steps per sequence).

Without a GPU (`capture=False`), the same buffers feed an eager forward pass: the padding and
the bookkeeping behave identically, which is how the CPU tests check them.

Week 20: a pipeline stage captures its own layers over these same buffers, from its input (token
ids, or the stream the stage before sent) to the stream it sends on: `StageGraphs`, in
nanoserve/runner/stage_graphs.py, overrides `_forward` and nothing else of the capture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext, PagedKVCache
from nanoserve.model.llama import Llama
from nanoserve.model.lora import LoRARows, LoRAState, group_rows
from nanoserve.scheduler.blocks import blocks_needed

if TYPE_CHECKING:
    from nanoserve.runner.step import StepInput

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIXED_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # week 15: tokens in a mixed step


def feed_last_tokens(ids: torch.Tensor, source: torch.Tensor, last: torch.Tensor) -> None:
    """Async scheduling: where `source` names a row of `last` (the previous step's sampled tokens, still on
    the device), that token is the input; elsewhere (-1) `ids` keeps the host's token. In place,
    with no wait for the GPU: the host never needs to see the token."""
    taken = last.index_select(0, source.clamp(min=0))
    torch.where(source >= 0, taken, ids, out=ids)


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes a decode graph is captured for: those of `CAPTURE_SIZES` up to `max_batch`."""
    return [s for s in CAPTURE_SIZES if s <= max_batch] or [1]


def padded_size(n: int, sizes: tuple[int, ...] | list[int]) -> int:
    """The smallest captured batch size that holds n sequences."""
    # >>> week12: padded-size
    return next(s for s in sizes if s >= n)
    # <<< week12: padded-size


class CUDAGraphDecoder:
    """Captures one decode graph per batch size and replays it with fresh inputs."""

    def __init__(self, model: Llama, cache: PagedKVCache, scratch_block: int, max_model_len: int, max_batch: int,
                 context_class: type[PagedContext], fused: bool, capture: bool | None = None,
                 verify_tokens: int = 0, verify_batch: int = 0, mixed_tokens: int = 0, lora: LoRAState | None = None):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.context_class, self.fused = context_class, fused
        self.sizes = capture_sizes(max_batch)
        device = model.embed_tokens.weight.device
        self.capture = device.type == "cuda" if capture is None else capture
        n = self.sizes[-1]
        self.max_blocks = blocks_needed(max_model_len, cache.block_size)
        self.scratch_slot = scratch_block * cache.block_size
        # Device buffers at fixed addresses, read by the graphs. inputs: ids, positions, slots, context lengths,
        # and (async scheduling, not read by the graphs) the row of the last step's tokens that is each row's
        # input, or -1.
        self.inputs = torch.zeros(5, n, dtype=torch.long, device=device)
        self.inputs[2] = self.scratch_slot
        self.inputs[3] = 1
        self.inputs[4] = -1
        # One row more than the largest batch: a mixed step's padding sequence (week 15).
        self.block_tables = torch.full((n + 1, self.max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self.tables_staging = torch.empty(n * self.max_blocks, dtype=torch.int32, device=device)
        # Host mirrors. Pinned memory lets the copies run asynchronously.
        pin = device.type == "cuda"
        self.host_inputs = self.inputs.cpu().pin_memory() if pin else self.inputs.clone()
        self.host_tables = torch.full((n + 1, self.max_blocks), scratch_block, dtype=torch.int32).numpy()
        self.host_compact = torch.empty(n * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.row_owner: list[tuple | None] = [None] * (n + 1)  # which table each host row holds
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each decode graph's output: logits (a pipeline stage's: a stream)
        # Week 17: verification steps, q tokens per sequence.
        self.verify_sizes = [s for s in self.sizes if s <= verify_batch] if verify_tokens else []
        self.verify_q = list(range(2, verify_tokens + 2)) if self.verify_sizes else []
        if self.verify_sizes:
            vb, vq = self.verify_sizes[-1], self.verify_q[-1]
            self.vinputs = torch.zeros(3, vb * vq, dtype=torch.long, device=device)  # ids, positions, slots
            self.vinputs[2] = self.scratch_slot
            self.vcontext = torch.ones(vb, dtype=torch.long, device=device)
            self.vstarts = {q: torch.arange(0, (vb + 1) * q, q, dtype=torch.int32, device=device) for q in self.verify_q}
            self.host_vinputs = self.vinputs.cpu().pin_memory() if pin else self.vinputs.clone()
            self.host_vcontext = self.vcontext.cpu().pin_memory() if pin else self.vcontext.clone()
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.verify_logits: dict[tuple[int, int], torch.Tensor] = {}
        # Week 15: mixed steps, up to `mixed_tokens` tokens and n sequences (+ 1 for padding).
        self.mixed_sizes = [t for t in MIXED_SIZES if t < mixed_tokens] + [mixed_tokens] if mixed_tokens else []
        if self.mixed_sizes:
            t, seqs = self.mixed_sizes[-1], n + 1
            self.minputs = torch.zeros(4, t, dtype=torch.long, device=device)  # ids, positions, slots, source
            self.mseqs = torch.zeros(2, seqs, dtype=torch.long, device=device)  # context lengths, sampled rows
            self.mstarts = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
            self.host_minputs = self.minputs.cpu().pin_memory() if pin else self.minputs.clone()
            self.host_mseqs = self.mseqs.cpu().pin_memory() if pin else self.mseqs.clone()
            self.host_mstarts = self.mstarts.cpu().pin_memory() if pin else self.mstarts.clone()
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_logits: dict[int, torch.Tensor] = {}
        # Async scheduling: when the host runs a step ahead, it may refill the pinned mirrors before the GPU
        # has copied the last step's values out of them; this event marks those copies done.
        self.copied = torch.cuda.Event() if self.capture else None
        # Week 23: the LoRA layers' rows of every graph, in fixed buffers: the rows grouped by adapter slot
        # and where each slot's group starts (all groups empty: no adapter, and the kernels return at once).
        self.lora = lora
        if lora is not None:
            verify = [self.verify_sizes[-1] * self.verify_q[-1]] if self.verify_sizes else []
            most = max([n, *verify, *self.mixed_sizes[-1:]])  # the most tokens of any graph
            self.lora_order = torch.zeros(most, dtype=torch.int32, device=device)
            self.lora_starts = torch.zeros(lora.max_loras + 1, dtype=torch.int32, device=device)
            self.host_lora_order = torch.zeros(most, dtype=torch.int32, pin_memory=pin)
            self.host_lora_starts = torch.zeros(lora.max_loras + 1, dtype=torch.int32, pin_memory=pin)
            # Every graph's LoRA layers read these (the kernels never read past a slot's rows, so one view of
            # the whole order buffer serves every size); the layers point at them while graphs are captured.
            self.lora_rows = LoRARows(self.lora_order, self.lora_starts)
            lora.rows = self.lora_rows
        if self.capture:
            self._capture()

    def stage_lora(self, step: StepInput) -> None:
        """Week 23: write the step's rows by adapter slot into the buffers (padding rows use none),
        through pinned mirrors as the other inputs. Called after a `stage*`, which waited for the
        last step's copies out of the mirrors; the event is recorded again once these are sent."""
        if self.lora is None:
            return
        self.lora.rows = self.lora_rows  # what a captured graph reads anyway; an uncaptured pass (CPU) needs it
        order, starts = group_rows(step.lora_slots, self.lora.max_loras)
        self.host_lora_starts.numpy()[:] = starts
        self.lora_starts.copy_(self.host_lora_starts, non_blocking=True)
        if order:
            self.host_lora_order.numpy()[: len(order)] = order
            self.lora_order[: len(order)].copy_(self.host_lora_order[: len(order)], non_blocking=True)
        self.copies_sent()

    def _decode_context(self, bs: int) -> PagedContext:
        """The attention context of `bs` decode rows (one token each), over the buffers."""
        slots, context_lens = self.inputs[2:4, :bs]
        meta = PagedAttentionMetadata(slot_mapping=slots, query_start_loc=self.query_start_loc[: bs + 1],
                                      context_lens=context_lens, block_tables=self.block_tables[:bs],
                                      max_query_len=1, max_context_len=self.max_model_len)
        return self.context_class(self.cache, meta, fused=self.fused)

    def _forward(self, bs: int) -> torch.Tensor:
        """The model's forward pass for `bs` decode rows, reading every input from the buffers (what a
        decode graph captures; a pipeline stage overrides it with its own layers, week 20)."""
        input_ids, positions = self.inputs[:2, :bs]
        hidden = self.model(input_ids, positions, self._decode_context(bs))
        return self.model.compute_logits(hidden)

    def _forward_verify(self, bs: int, q: int) -> torch.Tensor:
        """Week 17: the forward pass for `bs` sequences of q new tokens each, all rows sampled."""
        input_ids, positions, slots = self.vinputs[:, : bs * q]
        meta = PagedAttentionMetadata(slot_mapping=slots, query_start_loc=self.vstarts[q][: bs + 1],
                                      context_lens=self.vcontext[:bs], block_tables=self.block_tables[:bs],
                                      max_query_len=q, max_context_len=self.max_model_len)
        hidden = self.model(input_ids, positions, self.context_class(self.cache, meta, fused=self.fused))
        return self.model.compute_logits(hidden)

    def _forward_mixed(self, t: int) -> torch.Tensor:
        """Week 15: the forward pass of a mixed step padded to t tokens; logits of the sampled rows."""
        input_ids, positions, slots = self.minputs[:3, :t]
        context_lens, sampled = self.mseqs
        meta = PagedAttentionMetadata(slot_mapping=slots, query_start_loc=self.mstarts, context_lens=context_lens,
                                      block_tables=self.block_tables, max_query_len=t,
                                      max_context_len=self.max_model_len)
        hidden = self.model(input_ids, positions, self.context_class(self.cache, meta, fused=self.fused))
        return self.model.compute_logits(hidden[sampled])

    @torch.no_grad()
    def _capture(self) -> None:
        pool = None
        shapes = [(bs, 1) for bs in self.sizes] + [(bs, q) for bs in self.verify_sizes for q in self.verify_q]
        shapes += [(t, 0) for t in self.mixed_sizes]  # q = 0 marks a mixed step of t tokens
        for bs, q in sorted(shapes, key=lambda s: -s[0] * max(s[1], 1)):  # largest first: the others reuse its pool
            if q == 0:
                forward = lambda: self._forward_mixed(bs)  # noqa: E731
            else:
                forward = (lambda: self._forward(bs)) if q == 1 else (lambda: self._forward_verify(bs, q))
            forward()  # warm up: compiles kernels, moves lazily-placed tensors
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            pool = graph.pool()
            if q == 0:
                self.mixed_graphs[bs], self.mixed_logits[bs] = graph, logits
            elif q == 1:
                self.graphs[bs], self.outputs[bs] = graph, logits
            else:
                self.verify_graphs[bs, q], self.verify_logits[bs, q] = graph, logits
        torch.cuda.synchronize()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def stage(self, step: StepInput) -> int:
        """Copy one decode step's inputs into the static buffers; returns the padded batch size."""
        self.wait_for_copies()
        source = self.host_inputs.numpy()[4]  # async scheduling: which inputs come from the last step's tokens
        source[:] = -1
        for row, last_row in step.from_last:
            source[row] = last_row
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

    def verify_shape(self, step: StepInput) -> int | None:
        """Week 17: q if `step` is a verification step a graph was captured for (every sequence
        runs q new tokens and samples all of them), else None."""
        n, q = step.num_seqs, len(step.input_ids) // max(1, step.num_seqs)
        if not self.verify_sizes or q not in self.verify_q or n > self.verify_sizes[-1] \
                or len(step.sample_rows) != n * q or step.query_start_loc != list(range(0, n * q + 1, q)):
            return None
        return q

    def stage_verify(self, step: StepInput, q: int) -> int:
        """`stage` for a verification step: q tokens per sequence. Padding sequences run q tokens
        at positions 0 .. q - 1, all written to the scratch slot."""
        self.wait_for_copies()
        n = step.num_seqs
        bs = padded_size(n, self.verify_sizes)
        pad = (bs - n) * q
        host = self.host_vinputs.numpy()
        host[0, : bs * q] = step.input_ids + [0] * pad
        host[1, : bs * q] = step.positions + list(range(q)) * (bs - n)
        host[2, : bs * q] = step.slot_mapping + [self.scratch_slot] * pad
        self.host_vcontext.numpy()[:bs] = step.context_lens + [q] * (bs - n)
        self.vinputs.copy_(self.host_vinputs, non_blocking=True)
        self.vcontext.copy_(self.host_vcontext, non_blocking=True)
        self._stage_tables(step, bs)
        self.copies_sent()
        return bs

    def _stage_tables(self, step: StepInput, rows: int) -> None:
        """The block tables of a verification or mixed step, as `stage` sends a decode step's:
        host rows rewritten only where the table changed, the [rows, width] corner sent packed."""
        width = 1
        for i, (table, table_id) in enumerate(zip(step.block_tables, step.table_ids)):
            width = max(width, len(table))
            if self.row_owner[i] != (table_id, len(table)):
                self.host_tables[i, : len(table)] = table
                self.row_owner[i] = (table_id, len(table))
        compact = self.host_compact[: rows * width]
        compact.numpy().reshape(rows, width)[:] = self.host_tables[:rows, :width]
        staged = self.tables_staging[: rows * width]
        staged.copy_(compact, non_blocking=True)
        self.block_tables[:rows, :width].copy_(staged.view(rows, width))

    @torch.no_grad()
    def run_verify(self, step: StepInput, q: int) -> torch.Tensor:
        """One verification step -> logits [n * q, vocab]."""
        bs = self.stage_verify(step, q)
        self.stage_lora(step)
        rows = step.num_seqs * q
        if not self.capture:
            return self._forward_verify(bs, q)[:rows]
        self.verify_graphs[bs, q].replay()
        return self.verify_logits[bs, q][:rows]

    def mixed_size(self, step: StepInput) -> int | None:
        """Week 15: the token count of the mixed-step graph `step` fits, or None."""
        seqs = self.mseqs.shape[1] if self.mixed_sizes else 0
        if not self.mixed_sizes or step.num_seqs >= seqs or len(step.sample_rows) > seqs:
            return None
        return next((t for t in self.mixed_sizes if t >= len(step.input_ids)), None)

    def stage_mixed(self, step: StepInput, t: int) -> None:
        """Copy a mixed step into the buffers of the t-token graph. Sequences 0..n-1 are the
        step's; sequence n takes the t - R spare tokens (positions 0.., the scratch slot); the
        rest are empty. Block-table rows as in `stage`."""
        self.wait_for_copies()
        n, real, seqs = step.num_seqs, len(step.input_ids), self.mseqs.shape[1]
        spare = t - real
        host = self.host_minputs.numpy()
        host[0, :t] = step.input_ids + [0] * spare
        host[1, :t] = step.positions + list(range(spare))
        host[2, :t] = step.slot_mapping + [self.scratch_slot] * spare
        host[3, :t] = -1
        for row, last_row in step.from_last:  # async scheduling
            host[3, row] = last_row
        per_seq = self.host_mseqs.numpy()
        per_seq[0] = step.context_lens + [max(spare, 1)] + [1] * (seqs - n - 1)
        per_seq[1] = step.sample_rows + [0] * (seqs - len(step.sample_rows))
        self.host_mstarts.numpy()[:] = step.query_start_loc + [t] * (seqs - n)
        self.minputs.copy_(self.host_minputs, non_blocking=True)
        self.mseqs.copy_(self.host_mseqs, non_blocking=True)
        self.mstarts.copy_(self.host_mstarts, non_blocking=True)
        self._stage_tables(step, n)
        self.copies_sent()

    def wait_for_copies(self) -> None:
        """Async scheduling: before the pinned mirrors are refilled, the last step's copies out of them
        must have run (they follow the step before it on the GPU, so this rarely waits)."""
        if self.copied is not None:
            self.copied.synchronize()

    def copies_sent(self) -> None:
        if self.copied is not None:
            self.copied.record()

    @torch.no_grad()
    def run_mixed(self, step: StepInput, t: int, last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One mixed step -> logits of its sampled rows [len(step.sample_rows), vocab]."""
        self.stage_mixed(step, t)
        self.stage_lora(step)
        if step.from_last:  # async scheduling: inputs the host has not seen, from the last step's tokens
            feed_last_tokens(self.minputs[0, :t], self.minputs[3, :t], last_tokens)
        rows = len(step.sample_rows)
        if not self.capture:
            return self._forward_mixed(t)[:rows]
        self.mixed_graphs[t].replay()
        return self.mixed_logits[t][:rows]

    @torch.no_grad()
    def run(self, step: StepInput, last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step (one new token per sequence) -> logits [n, vocab]."""
        bs = self.stage(step)
        self.stage_lora(step)
        self.copies_sent()
        if step.from_last:  # async scheduling: inputs the host has not seen, from the last step's tokens
            k = len(step.from_last)
            if all(row == source == i for i, (row, source) in enumerate(step.from_last)):
                self.inputs[0, :k].copy_(last_tokens[:k])  # the same sequences in the same order: one copy
            else:
                feed_last_tokens(self.inputs[0, :bs], self.inputs[4, :bs], last_tokens)
        if not self.capture:
            return self._forward(bs)[: step.num_seqs]
        self.graphs[bs].replay()
        return self.outputs[bs][: step.num_seqs]
