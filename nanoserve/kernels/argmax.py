"""The greedy token of each row of logits, in one Triton launch (two with the fusion off).

`torch.argmax` reduces a row of 128,256 logits with one block of threads: on an H100 that takes
~27 µs, where reading the row takes under one (`docs/benchmarks.md`). Here the row is cut into
slices of `BLOCK` logits, and one program each finds its slice's maximum and the first index
holding it. The index is the one `torch.argmax` returns: the first of equal maxima. Logits are
assumed to hold no NaN (they never do here; `torch.argmax` would return a NaN's index).

Issue 20 picked among the slices with a second kernel. Issue 39 does it in the same launch: each
program folds its (maximum, index) into one 64-bit key per row with an atomic max, the key ordered
as the pair is (a larger value first, then a smaller index), and bumps the row's counter; the last
program of the row to do so reads the key, writes the index and resets both for the next call
(`nanoserve/kernels/fusion.py`). NANOSERVE_FUSE_OFF=argmax gives the two kernels back.

    key = (float bits of the maximum, made to order as signed integers) << 32 | (2^31 - 1 - index)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fusion import fusion_on, persistent_buffer

LOWEST_KEY = -(2**63)  # below every key a real logit makes


@triton.jit
def _slice_max(X, row, part, stride_x, vocab, BLOCK: tl.constexpr):
    """One slice of one row -> (its maximum in float32, the first column holding it)."""
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where((x == best) & (cols < vocab), cols, vocab), axis=0)  # the first column holding it
    return best, first


@triton.jit
def _slice_max_kernel(X, Values, Indices, stride_x, vocab, num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    best, first = _slice_max(X, row, part, stride_x, vocab, BLOCK)
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


@triton.jit
def _argmax_one_pass_kernel(X, Keys, Counts, Out, stride_x, vocab, num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    best, first = _slice_max(X, row, tl.program_id(1), stride_x, vocab, BLOCK)
    # >>> week12: argmax-one-launch
    best = tl.where(best == 0.0, 0.0, best)  # -0.0 becomes +0.0: equal to it, as in torch.argmax
    bits = best.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: flip all but the sign bit
    key = (ordered.to(tl.int64) << 32) | (2147483647 - first).to(tl.int64)
    tl.atomic_max(Keys + row, key)
    tl.debug_barrier()
    # acq_rel: this program's key is in before the count says so; the last one sees every key
    done = tl.atomic_add(Counts + row, 1, sem="acq_rel", scope="gpu")
    if done == num_slices - 1:
        lowest = tl.full([], -2147483648, tl.int64) << 32
        key = tl.atomic_xchg(Keys + row, lowest, sem="acq_rel", scope="gpu")  # read it, and reset it
        tl.store(Counts + row, 0)
        tl.store(Out + row, 2147483647 - (key & 2147483647))  # the low 32 bits
    # <<< week12: argmax-one-launch


def argmax(logits: torch.Tensor, block: int = 4096, one_pass: bool = True) -> torch.Tensor:
    """logits [N, V] -> int64 [N]: the index of each row's maximum (the first one on ties). One
    launch with `one_pass` (unless NANOSERVE_FUSE_OFF names argmax), else two."""
    rows, vocab = logits.shape
    num_slices = triton.cdiv(vocab, block)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if one_pass and fusion_on("argmax"):
        keys = persistent_buffer("argmax keys", logits.device, rows, torch.int64, LOWEST_KEY)
        counts = persistent_buffer("argmax counts", logits.device, rows, torch.int32, 0)
        _argmax_one_pass_kernel[(rows, num_slices)](logits, keys, counts, out, logits.stride(0), vocab, num_slices,
                                                     BLOCK=block)
        return out
    values = torch.empty(rows, num_slices, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_slices, dtype=torch.int32, device=logits.device)
    _slice_max_kernel[(rows, num_slices)](logits, values, indices, logits.stride(0), vocab, num_slices, BLOCK=block)
    _pick_slice_kernel[(rows,)](values, indices, out, num_slices, vocab, SLICES=triton.next_power_of_2(num_slices))
    return out
