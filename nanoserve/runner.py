"""Week 5: the model runner turns the scheduler's `Batch` into tensors and runs the model.

It is the only place where scheduling decisions (lists of sequences and token counts) meet
tensors. For each step it builds the packed inputs:

    input_ids, positions [T]    the new tokens of every scheduled sequence, back to back
    slot_mapping [T]            where each new token's K/V goes in the block pool
    query_start_loc [N + 1]     where each sequence's tokens start in the packed batch
    context_lens [N]            each sequence's length once this step is done
    block_tables [N, max_blocks]

then runs one forward pass and returns the logits of the rows to sample: each sequence's last
`batch.num_samples[i]` positions (its last token, usually).
"""

from __future__ import annotations

import torch

from nanoserve.blocks import slot_of
from nanoserve.cache import PagedContext, PagedKVCache
from nanoserve.model import Llama
from nanoserve.scheduler import Batch


class ModelRunner:
    def __init__(self, model: Llama, cache: PagedKVCache, attention_backend: str = "torch"):
        self.model = model
        self.cache = cache
        self.device = model.embed_tokens.weight.device
        self.context_class = PagedContext
        self.graph_decoder = None  # week 12: set by the engine when decode steps use CUDA graphs
        if attention_backend == "triton":  # week 6: same context interface, Triton inside
            from nanoserve.kernels.triton_backend import TritonPagedContext

            self.context_class = TritonPagedContext

    def metadata(self, batch: Batch) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
        """Batch -> python lists: input_ids, positions, slots, query_start_loc, context_lens, tables."""
        # >>> week05: prepare-inputs
        block_size = self.cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [slot_of(seq.block_table, p, block_size) for p in range(start, start + n)]
            query_start_loc.append(query_start_loc[-1] + n)
            context_lens.append(start + n)
        tables = [seq.block_table for seq in batch.seqs]
        return input_ids, positions, slots, query_start_loc, context_lens, tables
        # <<< week05: prepare-inputs

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, PagedContext]:
        """Batch -> (input_ids [T], positions [T], the attention context)."""
        input_ids, positions, slots, query_start_loc, context_lens, tables = self.metadata(batch)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]  # padded: one rectangular tensor
        dev = self.device
        ctx = self.context_class(
            self.cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), ctx)

    @torch.no_grad()
    def execute(self, batch: Batch) -> torch.Tensor:
        """One forward pass -> logits [sum(batch.num_samples), vocab] (float32), in batch order."""
        graphs = self.graph_decoder
        all_decode = batch.num_scheduled_tokens == len(batch) == sum(batch.num_samples)
        if graphs is not None and graphs.fits(len(batch)) and all_decode:
            return graphs.run(batch.seqs)  # week 12: one replay
        input_ids, positions, ctx = self.prepare(batch)
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        rows = [end - k for end, n in zip(ctx.query_start_loc[1:], batch.num_samples) for k in range(n, 0, -1)]
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])
