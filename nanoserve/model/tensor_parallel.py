"""Week 18: the sharded (tensor-parallel) layers, the process group they all-reduce over, and
the function that swaps them into a model. Nothing here starts a process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class Group:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    device_group: object | None = None  # the collectives of the forward pass (NCCL on CUDA, gloo on the CPU)
    cpu_group: object | None = None  # step descriptions, as pickled objects (gloo)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the sum."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)


def head_range(num_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The query heads rank `rank` of `size` computes: [first, last)."""
    per_rank = num_heads // size
    return rank * per_rank, (rank + 1) * per_rank


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The key/value heads rank `rank` of `size` keeps: [first, last).

    With at least as many KV heads as ranks, each rank keeps its share. With fewer, each KV head
    is *replicated*: rank r keeps the one KV head its query heads attend to (a group of query
    heads shares a KV head, and a rank's query heads all fall in one group).
    """
    # >>> week18: kv-heads
    if num_kv_heads >= size:
        per_rank = num_kv_heads // size
        return rank * per_rank, (rank + 1) * per_rank
    ranks_per_head = size // num_kv_heads
    head = rank // ranks_per_head
    return head, head + 1
    # <<< week18: kv-heads


def check_shardable(config, size: int) -> None:
    """Refuse, with the reason, a model that `size` ranks cannot split evenly."""
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        problems.append(f"{config.num_kv_heads} key/value heads (neither a multiple nor a divisor of the ranks)")
    if config.intermediate_size % size:
        problems.append(f"an MLP of {config.intermediate_size} features")
    if problems:
        raise ValueError(f"tensor parallelism over {size} ranks needs every split to be even; this model has "
                         f"{', '.join(problems)}")


def shard_qkv(weight: torch.Tensor, config, rank: int, size: int) -> torch.Tensor:
    """The rows of the fused qkv weight [(Hq + 2·Hkv)·D, hidden] that rank `rank` keeps: its query
    heads, then its key heads, then its value heads (the layout `Attention.forward` splits)."""
    # >>> week18: shard-qkv
    d = config.head_dim
    q, k, v = weight.split([config.q_size, config.kv_size, config.kv_size])
    q0, q1 = head_range(config.num_heads, rank, size)
    k0, k1 = kv_head_range(config.num_kv_heads, rank, size)
    return torch.cat([q[q0 * d : q1 * d], k[k0 * d : k1 * d], v[k0 * d : k1 * d]])
    # <<< week18: shard-qkv


def shard_gate_up(weight: torch.Tensor, intermediate_size: int, rank: int, size: int) -> torch.Tensor:
    """The rows of the fused gate_up weight [2·I, hidden] rank `rank` keeps: its slice of gate, then
    the same slice of up (so SwiGLU pairs them on the rank, with no communication)."""
    gate, up = weight.split(intermediate_size)
    per_rank = intermediate_size // size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return torch.cat([gate[rows], up[rows]])


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ for a slice of W's rows (output features): no communication."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_r W_rᵀ, for a slice of W's columns (input features) and the matching slice of
    x: each rank has a partial sum; the all-reduce adds them."""

    def __init__(self, weight: torch.Tensor, group: Group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # >>> week18: row-parallel
        partial = F.linear(x, self.weight)  # [T, out]: my inputs' share of the output
        return self.group.all_reduce(partial)
        # <<< week18: row-parallel


class VocabParallelEmbedding(nn.Module):
    """My rows [start, start + n) of the embedding. Ids outside them look up zeros; the all-reduce
    fills each token's row from the rank that holds it."""

    def __init__(self, weight: torch.Tensor, start: int, group: Group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # >>> week18: vocab-embedding
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x.masked_fill(~mine.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)
        # <<< week18: vocab-embedding


class VocabParallelLMHead(nn.Module):
    """Logits for my slice of the vocabulary, all-gathered into whole rows (and the padding rows,
    added to make the vocabulary split evenly, cut off)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group: Group):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(F.linear(hidden, self.weight))[..., : self.vocab_size]


def _vocab_shard(weight: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """Rank `rank`'s rows of an embedding-shaped weight [V, hidden], padded with zero rows so that
    V splits evenly; and the first vocabulary id they hold."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // size)  # ceil
    start = rank * per_rank
    rows = weight[start : min(start + per_rank, vocab)]
    if rows.shape[0] < per_rank:
        rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], weight.shape[1])])
    return rows.clone(), start


@torch.no_grad()
def shard_model(model, group: Group):
    """Turn a whole loaded `Llama` into rank `group.rank`'s shard of it, in place: parallel layers
    swapped in, head counts and sizes made local, `model.config` the local view (so the KV cache,
    kernels and CUDA graphs built from it get this rank's shapes). Returns the model."""
    cfg, rank, size = model.config, group.rank, group.size
    check_shardable(cfg, size)
    q0, q1 = head_range(cfg.num_heads, rank, size)
    k0, k1 = kv_head_range(cfg.num_kv_heads, rank, size)
    heads, kv_heads, inter = q1 - q0, k1 - k0, cfg.intermediate_size // size
    d = cfg.head_dim
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = ColumnParallelLinear(shard_qkv(attn.qkv_proj.weight, cfg, rank, size))
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q0 * d : q1 * d].clone(), group)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.q_size, attn.kv_size = heads * d, kv_heads * d
        mlp.gate_up_proj = ColumnParallelLinear(shard_gate_up(mlp.gate_up_proj.weight, cfg.intermediate_size, rank, size))
        per_rank = slice(rank * inter, (rank + 1) * inter)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, per_rank].clone(), group)
        mlp.intermediate_size = inter
    tied = model.lm_head.weight is model.embed_tokens.weight
    rows, start = _vocab_shard(model.embed_tokens.weight, rank, size)
    model.embed_tokens = VocabParallelEmbedding(rows, start, group)
    head_rows = model.embed_tokens.weight if tied else _vocab_shard(model.lm_head.weight, rank, size)[0]
    model.lm_head = VocabParallelLMHead(head_rows, cfg.vocab_size, group)
    # The local view: what this rank's attention, MLP and KV cache hold. vocab_size stays whole
    # (the logits are gathered), and so does hidden_size (every rank has whole hidden states).
    model.config = dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
    model.group = group
    return model


def min_over_ranks(group: Group, value: int) -> int:
    """The smallest of every rank's value (KV pool sizes: the block tables must fit everywhere)."""
    if group.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())

