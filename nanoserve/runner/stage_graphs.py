"""Week 20: CUDA graphs for one pipeline stage's share of a decode micro-batch.

A decode micro-batch is host-bound on a stage exactly as a decode step is on one GPU (week 12):
a few rows through the stage's layers, hundreds of kernel launches, each far shorter on the GPU
than on the host that issues it. So each stage captures its own layers, per batch size, with week
12's machinery unchanged (`CUDAGraphDecoder`: the fixed input buffers, the padding to a captured
size, the scratch slot, the block-table bookkeeping); only the captured function differs:

    stage 0        token ids (the buffers' row 0)      -> its layers -> the stream it sends on
    stage s > 0    the received stream (`stream_in`)   -> its layers -> the stream it sends on

and on the last stage the stream out is the one whose sampled rows go back to stage 0.

What stays outside the graph: the transfers. A receive lands in a tensor of its own (the receive
for the next micro-batch is posted while this one runs), and is copied into `stream_in` just
before the replay; the stream out is copied out of the graph's output before it is sent, since
the next replay rewrites that output while the send may still be reading it. Stage 0's head
(the final norm and lm_head over the rows sent back) stays eager: it is a handful of launches
against the layers' hundreds, and its rows come back micro-batch by micro-batch (with the rows
prompt logprobs score, in prompt steps), so a graph of it would need shapes of its own.

Padding, the same on every rank. Every rank cuts the same `StepInput` into the same micro-batches
(nanoserve/runner/pipeline.py), so every stage pads micro-batch i of n sequences to the same
captured size bs, and every stage writes its padding rows' K/V to its own scratch slot. Only the n
real rows travel: each stage sends `[n, hidden]`, which is what the next stage, having cut the same
micro-batch, expects. A micro-batch that is not all decodes, or has more sequences than the largest
size, runs eagerly on every stage, for the same reason.

Without a GPU (`capture=False`) the same buffers, padding and copies feed an eager pass over the
stage's layers: that is what the CPU tests check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention.paged import PagedContext, PagedKVCache
from nanoserve.model.llama import Llama
from nanoserve.model.pipeline import stage_forward
from nanoserve.runner.cuda_graphs import CUDAGraphDecoder, capture_sizes

if TYPE_CHECKING:
    from nanoserve.runner.step import StepInput


class StageGraphs(CUDAGraphDecoder):
    """Week 12's decode graphs over one stage's layers (`model.stage`, set by `cut_stage`). Decode
    graphs only: mixed steps run eagerly under a pipeline, and speculation is refused there."""

    def __init__(self, model: Llama, cache: PagedKVCache, scratch_block: int, max_model_len: int, max_batch: int,
                 context_class: type[PagedContext], fused: bool, capture: bool | None = None):
        self.place = model.stage  # (`stage` is the base class's: it stages the inputs)
        rows, hidden = capture_sizes(max_batch)[-1], model.config.hidden_size
        # A later stage's input at a fixed address, in the model's dtype (kept by the empty tables of
        # `cut_stage`); it must exist before the base class captures.
        self.stream_in = None if self.place.is_first else model.embed_tokens.weight.new_zeros(rows, hidden)
        super().__init__(model, cache, scratch_block, max_model_len, max_batch, context_class, fused, capture)

    def _forward(self, bs: int) -> torch.Tensor:
        """This stage's layers over `bs` decode rows from the buffers: the stream out, [bs, hidden]."""
        inputs = self.inputs[0, :bs] if self.place.is_first else self.stream_in[:bs]
        return stage_forward(self.model, inputs, self.inputs[1, :bs], self._decode_context(bs))

    @torch.no_grad()
    def run_stage(self, step: StepInput, received: torch.Tensor | None) -> torch.Tensor:
        """One decode micro-batch of n sequences through this stage (`received`: the stream from the
        stage before, [n, hidden]; None on stage 0) -> the stream to send on, [n, hidden]: the real
        rows only, in a tensor of their own."""
        bs = self.stage(step)
        self.copies_sent()
        n = step.num_seqs
        if received is not None:
            self.stream_in[:n].copy_(received)
            # The first layer keeps its input as the residual, and week 12's fused norm adds into that in
            # place: padding rows left alone would grow from replay to replay. Zeros each time instead.
            self.stream_in[n:bs].zero_()
        if not self.capture:
            return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n].clone()  # the next replay rewrites the output; the send may not have read it
