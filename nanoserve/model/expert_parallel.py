"""Week 24: expert parallelism. The experts of every MoE layer split over the ranks; the tokens
travel to the experts they chose and back, with two all-to-alls.

Tensor parallelism (week 18) cuts every weight matrix and all-reduces partial sums. An expert is
small and whole: each rank keeps E / N whole experts instead (rank r: experts r·E/N .. (r+1)·E/N - 1)
and the *tokens* move. Attention, the router, the shared expert, the embeddings and the LM head
are replicated: every rank runs the same step on the same tokens (the driver broadcasts it, as
with tensor parallelism), so every rank has every token's hidden state when an MoE layer begins.

Each rank then takes its own share of the tokens (a 1/N slice of the step) and, per layer:

    route my tokens ─▶ sort their (token, slot) pairs by expert, hence by the rank that holds it
    ─▶ all-to-all #0: how many pairs each rank sends me for each of my experts (E integers)
    ─▶ all-to-all #1 (dispatch): the pairs' hidden states to their experts' ranks
    ─▶ my experts on the rows I received (the loop, or the grouped kernels: k = 1, weight 1)
    ─▶ all-to-all #2 (combine): each result back to the rank its token came from, same order
    ─▶ weighted sum of each token's k results ─▶ all-gather: every rank has every token again

An expert's work is done once, on its own rank, for the tokens of every rank. The last all-gather
exists because attention is replicated here; with attention split by data (each rank its own
requests, as large deployments do) a rank's slice would simply be its own batch, and it would go.
`exchange` (the lesson's first version) sends exactly the pairs: their counts go to the host to
size the all-to-alls, a wait for the GPU in every layer, and a CUDA graph cannot hold that (a graph
replays fixed sizes; reading a value mid-capture is an error). `exchange_fixed` sends every rank a
buffer of a fixed capacity instead, the worst case of rows my slice can send one rank, real pairs
first, then padding rows marked with an expert id that names none of the receiver's experts (the
experts skip them). Its sizes follow from the step's token count alone: no value goes to the host,
and the engine captures expert-parallel steps in CUDA graphs with it (`use_fixed_capacity`).
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.model.moe import MoEBlock, combine, moe_blocks
from nanoserve.model.tensor_parallel import Group


class ExpertParallel:
    """How one MoE block reaches experts on other ranks (its `parallel`). `num_experts`: the model's."""

    def __init__(self, group: Group, num_experts: int, fixed_capacity: bool = False):
        self.group, self.num_experts = group, num_experts
        self.num_local = num_experts // group.size
        self.fixed_capacity = fixed_capacity  # exchange_fixed (a CUDA graph can hold it) instead of exchange

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, run_experts) -> torch.Tensor:
        """The whole step's x [T, H] (every rank the same), its routing [T, k] -> the block's output
        [T, H]; `run_experts` runs this rank's experts (local ids) on the rows they receive."""
        T, n = x.shape[0], self.group.size
        share = -(-T // n)  # rows per rank (the last ranks may have fewer, or none)
        first = min(self.group.rank * share, T)
        last = min(first + share, T)
        if self.fixed_capacity:  # the most pairs of a slice one rank can get: a token picks k distinct experts
            capacity = share * min(ids.shape[1], self.num_local)
            mine = self.exchange_fixed(x[first:last], weights[first:last], ids[first:last], run_experts, capacity)
        else:
            mine = self.exchange(x[first:last], weights[first:last], ids[first:last], run_experts)
        padded = mine.new_zeros(share, x.shape[1])
        padded[: last - first] = mine
        return self.group.all_gather(padded, dim=0)[:T]

    def exchange(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, run_experts) -> torch.Tensor:
        """Dispatch my tokens' pairs to their experts, run mine, combine what comes back: [t, H]."""
        # >>> week24: ep-dispatch
        k, n = ids.shape[1], self.group.size
        flat = ids.flatten()  # [t * k]
        order = flat.sort(stable=True).indices  # pairs by expert: rank 0's experts first, then rank 1's...
        sent = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        received = self.group.all_to_all(sent)  # [n * local]: row r holds what rank r sends my experts
        send_splits = sent.view(n, self.num_local).sum(1).tolist()
        recv_splits = received.view(n, self.num_local).sum(1).tolist()
        rows = self.group.all_to_all(x[order // k], recv_splits, send_splits)  # [R, H], by source, by expert
        local = torch.arange(self.num_local, device=x.device).repeat(n)
        local_ids = local.repeat_interleave(received)[:, None]  # [R, 1]: each row's expert among mine
        out = run_experts(rows, torch.ones(local_ids.shape, device=x.device), local_ids)  # [R, H]
        back = self.group.all_to_all(out, send_splits, recv_splits)  # [t * k, H], in `order`
        pair_out = torch.empty_like(back)
        pair_out[order] = back
        return combine(pair_out, weights).to(x.dtype)
        # <<< week24: ep-dispatch

    def exchange_fixed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, run_experts,
                       capacity: int) -> torch.Tensor:
        """`exchange` with sizes that depend only on the step's token count, never on the routing: I send
        every rank `capacity` rows (at least the most pairs of my slice its experts can get), my pairs for
        it first, then padding rows whose expert id is `num_local`: one past the receiver's experts, which
        skip it. The same sizes back. Nothing goes to the host, so a CUDA graph can hold it. -> [t, H]"""
        k, n, local = ids.shape[1], self.group.size, self.num_local
        flat = ids.flatten()  # [t * k]
        dest = flat // local  # [t * k]: the rank that holds each pair's expert
        to_rank = (dest[:, None] == torch.arange(n, device=x.device)).long()  # [t * k, n]
        before = to_rank.cumsum(0).gather(1, dest[:, None])[:, 0] - 1  # my pairs for that rank before this one
        row = dest * capacity + before  # [t * k]: each pair's row in the buffer I send, rank by rank
        send_ids = torch.full((n * capacity,), local, dtype=flat.dtype, device=x.device)  # padding: no expert
        send_ids.index_copy_(0, row, flat - dest * local)  # the expert among the receiver's own
        pair_x = x[:, None].expand(-1, k, -1).reshape(-1, x.shape[1])  # [t * k, H]: each pair's token
        send = x.new_zeros(n * capacity, x.shape[1]).index_copy_(0, row, pair_x)
        local_ids = self.group.all_to_all(send_ids)[:, None]  # [n * capacity, 1]: rank 0's rows for me, then 1's...
        rows = self.group.all_to_all(send)  # [n * capacity, H]
        out = run_experts(rows, torch.ones(local_ids.shape, device=x.device), local_ids)  # padding rows: not read
        back = self.group.all_to_all(out)  # [n * capacity, H]: row j holds the result of the row j I sent
        return combine(back.index_select(0, row), weights).to(x.dtype)


def check_expert_parallel(config, size: int) -> None:
    """Refuse, with the reason, a model whose experts `size` ranks cannot share evenly."""
    if size < 1:
        raise ValueError(f"expert_parallel_size must be at least 1, not {size}")
    if size == 1:
        return
    if not config.num_experts:
        raise ValueError(f"--expert-parallel-size splits the experts of a mixture of experts; {config.architecture} "
                         "is a dense model (use --tensor-parallel-size or --data-parallel-size)")
    if config.num_experts % size:
        raise ValueError(f"expert parallelism over {size} ranks needs the {config.num_experts} experts of each "
                         f"layer to split evenly: use a divisor of {config.num_experts}")


def use_fixed_capacity(model, on: bool = True) -> None:
    """Give every expert-parallel MoE block of the model `exchange_fixed` (or, with on=False, `exchange`
    back): the engine does so when it captures steps in CUDA graphs."""
    for block in moe_blocks(model):
        if block.parallel is not None:
            block.parallel.fixed_capacity = on


@torch.no_grad()
def shard_experts(model, group: Group):
    """Keep rank `group.rank`'s experts of every MoE block of a whole loaded model, in place, and
    give each block the all-to-alls that reach the others. Returns the model."""
    check_expert_parallel(model.config, group.size)
    blocks: list[MoEBlock] = moe_blocks(model)
    for block in blocks:
        parallel = ExpertParallel(group, block.num_experts)
        mine = slice(group.rank * parallel.num_local, (group.rank + 1) * parallel.num_local)
        block.w13 = nn.Parameter(block.w13[mine].clone(), requires_grad=False)
        block.w2 = nn.Parameter(block.w2[mine].clone(), requires_grad=False)
        block.parallel = parallel
    model.group = group
    return model
