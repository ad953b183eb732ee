"""Week 23: the shrink and expand kernels equal the PyTorch reference (`add_lora`), through Triton's
interpreter on the CPU (compiled on a GPU), for any mix of adapter slots, ranks and shapes; and the
LoRA layer packs a fused projection's pieces as one block-diagonal adapter."""

import pytest
import torch
from torch import nn

from nanoserve.model.lora import LoRALinear, LoRARows, LoRAState, Piece, add_lora, group_rows, lora_rows

pytest.importorskip("triton", reason="week 23's kernels need the triton package: pip install triton (Linux)")
from nanoserve.kernels.lora import add_lora_triton, lora_shrink  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_slots(g, num_tokens: int, num_slots: int, none_share: float) -> list[int]:
    return [-1 if torch.rand(1, generator=g).item() < none_share else int(torch.randint(num_slots, (1,), generator=g))
            for _ in range(num_tokens)]


@pytest.mark.exercise("segments")
def test_rows_grouped_by_slot():
    """The lesson's worked example: rows in order of their slot, each slot's rows in row order,
    rows of no adapter left out; `starts` has one more entry than there are slots."""
    assert group_rows([2, -1, 0, 2, 1, 0], 3) == ([2, 5, 4, 0, 3], [0, 2, 3, 5])
    assert group_rows([1, 1, 1], 4) == ([0, 1, 2], [0, 0, 3, 3, 3])  # empty segments: equal starts
    assert group_rows([-1, -1], 2) == ([], [0, 0, 0])
    assert group_rows([], 1) == ([], [0, 0])


@pytest.mark.exercise("lora-delta")
def test_unmerged_equals_merged():
    """Each row gets x (W + B[s] A[s])ᵀ for its own slot s, as if that adapter were merged into W;
    a row of no adapter gets x Wᵀ exactly. The sum is added into y, in place, and y is returned."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(24, 40, generator=g)
    a, b = torch.randn(3, 8, 40, generator=g), torch.randn(3, 24, 8, generator=g)
    x = torch.randn(6, 40, generator=g)
    slots = [1, -1, 0, 1, 2, -1]
    y = x @ w.T
    base = y.clone()
    out = add_lora(y, x, a, b, lora_rows(slots, 3, "cpu"))
    assert out is y
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.equal(y[i], base[i])
        else:
            torch.testing.assert_close(y[i], x[i] @ (w + b[s] @ a[s]).T, rtol=1e-4, atol=1e-4)


@pytest.mark.exercise("sgmv-shrink")
@pytest.mark.parametrize("num_tokens,k,n,slots,rank,none_share", [
    (1, 64, 96, 2, 8, 0.0),  # one decode row
    (7, 40, 72, 3, 12, 0.3),  # ragged sizes: every mask at work
    (33, 128, 64, 4, 16, 0.5),  # more rows than one block of a segment
    (50, 64, 200, 1, 48, 0.1),  # a fused layer's rank (3 × 16)
    (16, 32, 32, 3, 4, 1.0),  # no row has an adapter
])
def test_kernels_equal_the_reference(num_tokens, k, n, slots, rank, none_share):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, k, generator=g).to(DEVICE)
    a = torch.randn(slots, rank, k, generator=g).to(DEVICE)
    b = torch.randn(slots, n, rank, generator=g).to(DEVICE)
    y = torch.randn(num_tokens, n, generator=g).to(DEVICE)
    row_slots = random_slots(g, num_tokens, slots, none_share)
    rows = lora_rows(row_slots, slots, DEVICE)
    if rows is None:  # nothing to add: the layers skip the products; the kernels on empty segments add nothing too
        order, starts = group_rows(row_slots, slots)
        rows = LoRARows(torch.zeros(num_tokens, dtype=torch.int32, device=DEVICE),
                        torch.tensor(starts, dtype=torch.int32, device=DEVICE))
        assert torch.equal(add_lora_triton(y.clone(), x, a, b, rows), y)
        return
    expected = add_lora(y.clone(), x, a, b, rows)
    got = add_lora_triton(y.clone(), x, a, b, rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    untouched = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[untouched], y[untouched])  # rows of the base model keep the base output exactly


@pytest.mark.exercise("sgmv-shrink")
def test_graph_buffers_read_as_eager_rows():
    """A CUDA graph's rows: a fixed order buffer longer than this step, the starts on the device, no
    host groups. Padding rows (past the real ones) are in no segment and keep their base output."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 48, generator=g)
    a, b = torch.randn(3, 16, 32, generator=g), torch.randn(3, 48, 16, generator=g)
    slots = [2, -1, 0, 2, 1] + [-1] * 3  # five real rows, three padding
    order, starts = group_rows(slots, 3)
    buffer = torch.full((64,), 7, dtype=torch.int32)  # stale values past the step's rows must not matter
    buffer[: len(order)] = torch.tensor(order, dtype=torch.int32)
    graph_rows = LoRARows(buffer[:8], torch.tensor(starts, dtype=torch.int32))
    expected = add_lora(y.clone(), x, a, b, lora_rows(slots, 3, "cpu"))
    torch.testing.assert_close(add_lora_triton(y.clone(), x, a, b, graph_rows), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(add_lora(y.clone(), x, a, b, graph_rows), expected)  # the reference reads them too
    assert torch.equal(expected[5:], y[5:])


@pytest.mark.exercise("sgmv-shrink")
def test_shrink_writes_each_rows_own_slot():
    x = torch.eye(4, 32)[:3] * 2  # rows pick input features 0, 1, 2
    a = torch.arange(2 * 16 * 32, dtype=torch.float32).view(2, 16, 32)
    rows = lora_rows([1, 0, 1], 2, "cpu")
    t = lora_shrink(x, a, rows).sum(0)  # t[i] = x[i] A[slot]ᵀ, from the partial sums
    assert torch.equal(t[0], 2 * a[1, :, 0]) and torch.equal(t[1], 2 * a[0, :, 1]) and torch.equal(t[2], 2 * a[1, :, 2])


@pytest.mark.exercise("fuse-pieces")
def test_a_slot_holds_its_pieces_block_diagonally():
    """The lesson's worked example: q, k, v pieces of ranks 2, 3 and 1 in a slot of rank 3 × 4 = 12.
    A's rows 0-1, 2-4 and 5 are the pieces' A; B's blocks sit at the pieces' output rows and the same
    rank columns; everything else is zero, whatever the slot held before."""
    base = nn.Linear(16, 8 + 4 + 4, bias=False)
    layer = LoRALinear(base, LoRAState(max_loras=2, max_rank=4), num_pieces=3)
    assert layer.lora_a.shape == (2, 12, 16) and layer.lora_b.shape == (2, 16, 12)
    layer.lora_a.fill_(9.0)  # a previous adapter's values
    layer.lora_b.fill_(9.0)
    pieces = [Piece(torch.full((2, 16), 1.0), torch.full((8, 2), 10.0), 0),
              Piece(torch.full((3, 16), 2.0), torch.full((4, 3), 20.0), 8),
              Piece(torch.full((1, 16), 3.0), torch.full((4, 1), 30.0), 12)]
    layer.set_slot(1, pieces)
    a, b = layer.lora_a[1], layer.lora_b[1]
    assert a[:, 0].tolist() == [1, 1, 2, 2, 2, 3] + [0] * 6
    expected_b = torch.zeros(16, 12)
    expected_b[0:8, 0:2], expected_b[8:12, 2:5], expected_b[12:16, 5:6] = 10.0, 20.0, 30.0
    assert torch.equal(b, expected_b)
    assert torch.equal(layer.lora_a[0], torch.full((12, 16), 9.0))  # another slot is left alone
    layer.set_slot(1, [])  # no pieces (an adapter that leaves this layer alone): all zeros
    assert not layer.lora_a[1].any() and not layer.lora_b[1].any()


@pytest.mark.exercise("fuse-pieces")
def test_a_fused_layer_holds_its_pieces_block_diagonally():
    """q, k and v pieces of ranks 2, 3 and 1 in one LoRA layer = three separate products, each added
    to its own rows of the output; a slot with no pieces adds nothing."""
    g = torch.Generator().manual_seed(3)
    base = nn.Linear(16, 8 + 4 + 4, bias=False)
    layer = LoRALinear(base, LoRAState(max_loras=2, max_rank=4), num_pieces=3)
    pieces = [Piece(torch.randn(2, 16, generator=g), torch.randn(8, 2, generator=g), 0),
              Piece(torch.randn(3, 16, generator=g), torch.randn(4, 3, generator=g), 8),
              Piece(torch.randn(1, 16, generator=g), torch.randn(4, 1, generator=g), 12)]
    layer.set_slot(1, pieces)
    x = torch.randn(3, 16, generator=g)
    layer.state.rows = lora_rows([1, -1, 0], 2, "cpu")
    with torch.no_grad():
        y = layer(x)
        plain = base(x)
    expected = plain[0].clone()
    for p in pieces:
        expected[p.offset : p.offset + p.b.shape[0]] += p.b @ (p.a @ x[0])
    torch.testing.assert_close(y[0], expected)
    assert torch.equal(y[1], plain[1]) and torch.equal(y[2], plain[2])  # no adapter; an empty slot
