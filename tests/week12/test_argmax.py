"""Issue 20: on a GPU the engine's greedy rows take their token from a two-kernel Triton argmax
(`nanoserve/kernels/argmax.py`): the same index as `torch.argmax`, ties included (the first of
equal maxima). On the CPU the kernels run in Triton's interpreter."""

import pytest
import torch

pytest.importorskip("triton", reason="the argmax is a Triton kernel: pip install triton (Linux)")

from nanoserve.kernels.argmax import argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,vocab,block", [(1, 128256, 4096), (3, 5000, 1024), (5, 49152, 4096), (2, 1000, 256)])
def test_same_index_as_torch(rows, vocab, block):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE)
    assert torch.equal(argmax(logits, block), logits.argmax(dim=-1))


def test_ties_and_infinities():
    logits = torch.zeros(5, 1000)
    logits[0, [700, 65]] = 3.0  # two maxima in different slices
    logits[1, [130, 100]] = 2.0  # two in one slice
    logits[2, [999, 0]] = 1.0  # the last column and the first
    logits[4] = float("-inf")  # every token masked but one (a grammar's mask)
    logits[4, 999] = -1.0
    logits = logits.to(DEVICE)
    assert argmax(logits, 256).tolist() == logits.argmax(dim=-1).tolist() == [65, 100, 0, 0, 999]
