"""The greedy token of each row of logits, in two small Triton kernels.

`torch.argmax` reduces a row of 128,256 logits with one block of threads: on an H100 that takes
~27 µs, where reading the row takes under one (`docs/benchmarks.md`). Here the row is cut into
slices of `BLOCK` logits, one program each finds its slice's maximum and the first index holding
it, and a second kernel picks, among the slices' maxima, the first slice holding the largest. The
index is the one `torch.argmax` returns: the first of equal maxima. Logits are assumed to hold no
NaN (they never do here; `torch.argmax` would return a NaN's index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slice_max_kernel(X, Values, Indices, stride_x, vocab, num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where((x == best) & (cols < vocab), cols, vocab), axis=0)  # the first column holding it
    tl.store(Values + row * num_slices + part, best)
    tl.store(Indices + row * num_slices + part, first)


@triton.jit
def _pick_slice_kernel(Values, Indices, Out, num_slices, vocab, SLICES: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SLICES)
    v = tl.load(Values + row * num_slices + s, mask=s < num_slices, other=float("-inf"))
    i = tl.load(Indices + row * num_slices + s, mask=s < num_slices, other=vocab)
    best = tl.max(v, axis=0)
    tl.store(Out + row, tl.min(tl.where(v == best, i, vocab), axis=0).to(tl.int64))


def argmax(logits: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """logits [N, V] -> int64 [N]: the index of each row's maximum (the first one on ties)."""
    rows, vocab = logits.shape
    num_slices = triton.cdiv(vocab, block)
    values = torch.empty(rows, num_slices, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_slices, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _slice_max_kernel[(rows, num_slices)](logits, values, indices, logits.stride(0), vocab, num_slices, BLOCK=block)
    _pick_slice_kernel[(rows,)](values, indices, out, num_slices, vocab, SLICES=triton.next_power_of_2(num_slices))
    return out
