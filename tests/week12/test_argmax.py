"""Issue 20: the engine's greedy rows take their argmax in two passes (`argmax_rows`): the same
token as `torch.argmax`, ties included (the first of equal maxima wins)."""

import pytest
import torch

from nanoserve.sampling import argmax_rows


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (3, 4096), (7, 49152), (2, 1000)])
def test_same_index_as_argmax(rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=g)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_go_to_the_first_maximum():
    vocab = 1024
    logits = torch.zeros(5, vocab)
    # row 0: a tie inside one slice; 1: across slices; 2: last and first; 3: everything equal; 4: -inf but one
    logits[0, [70, 65]] = 3.0
    logits[1, [900, 100, 500]] = 2.0
    logits[2, [vocab - 1, 0]] = 1.0
    logits[4] = float("-inf")
    logits[4, 777] = -5.0
    assert argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist() == [65, 100, 0, 0, 777]


def test_bfloat16_rows():
    logits = torch.randn(4, 2048, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
