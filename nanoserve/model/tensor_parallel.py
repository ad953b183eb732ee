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
    one_shot: "OneShotAllReduce | None" = None  # week 20: small sums over peer-to-peer memory instead

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; every rank gets the sum (use the result: in place with NCCL, a
        new tensor from the one-shot path)."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x (the same shape on every rank) along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """Week 24: rank r sends rows in_splits[r'] of x (in order) to each rank r', and gets
        out_splits[r'] rows from each; the rows received, in rank order. No splits: equal shares (sizes
        known without looking at any value: a CUDA graph can hold it, as it holds the all-reduce)."""
        if self.size == 1:
            return x
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.device_group)
        return out


class OneShotAllReduce:
    """Week 20: an all-reduce for small messages, in one kernel over peer-to-peer memory.

    NCCL's ring sends a message around the ranks in 2(N − 1) hops, each a handshake between two
    GPUs: for the 8 KB a decode step all-reduces (one token's hidden state) the handshakes are
    all the cost, ~16 µs a call in a CUDA graph on two H100s. Here every rank has a buffer the
    others can read directly over NVLink (symmetric memory: the same allocation mapped into every
    rank's address space). One kernel copies this rank's x into its buffer, waits at a barrier
    until every rank has done the same (flags in a small "signal pad", also peer-mapped), then
    reads all N buffers and adds them: one hop, ~10 µs. It reads N − 1 times the message from the
    peers, so it loses to the ring once messages are large; `max_bytes` is where (measured,
    `scripts/bench_all_reduce.py`).

    Two buffers, used in turn: a rank may start writing its next message while a slower peer
    still reads its last one, and the barrier of the call in between guarantees that every peer
    has finished reading the buffer before this one is written again.
    """

    def __init__(self, group: Group, dtype: torch.dtype, device: str, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.device_group.group_name
        self.max_elements = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        self.buffers = [symm_mem.empty(self.max_elements, dtype=dtype, device=device) for _ in range(2)]
        for buffer in self.buffers:  # collective: every rank maps every rank's buffer
            symm_mem.rendezvous(buffer, self.group_name)
        self.turn = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_elements and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers[self.turn][: x.numel()].view(x.shape)
        self.turn ^= 1
        out = torch.empty_like(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x, "sum", self.group_name, out)


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
    if getattr(config, "architecture", "LlamaForCausalLM") != "LlamaForCausalLM":
        raise ValueError(f"tensor parallelism is written for Llama checkpoints (week 18); {config.architecture} "
                         "runs on one GPU (or several as data-parallel replicas: --data-parallel-size)")
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
    # >>> week18: shard-model
    cfg, rank, size = model.config, group.rank, group.size
    check_shardable(cfg, size)
    d = cfg.head_dim
    q0, q1 = head_range(cfg.num_heads, rank, size)
    k0, k1 = kv_head_range(cfg.num_kv_heads, rank, size)
    heads, kv_heads, inter = q1 - q0, k1 - k0, cfg.intermediate_size // size
    features = slice(rank * inter, (rank + 1) * inter)  # my share of the MLP's features
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # Column-parallel by heads: my query heads' rows, then my KV heads' rows of k and of v,
        # the order in which Attention.forward splits its output with the local sizes set below.
        q, k, v = attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        rows = [q[q0 * d : q1 * d], k[k0 * d : k1 * d], v[k0 * d : k1 * d]]
        attn.qkv_proj = ColumnParallelLinear(torch.cat(rows))
        # Row-parallel: the columns of o_proj that read my heads' outputs.
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q0 * d : q1 * d].clone(), group)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.q_size, attn.kv_size = heads * d, kv_heads * d
        # The same features of gate and of up, so SwiGLU pairs them on this rank; then the
        # matching columns of down_proj, whose partial sums the all-reduce adds.
        gate, up = mlp.gate_up_proj.weight.split(cfg.intermediate_size)
        mlp.gate_up_proj = ColumnParallelLinear(torch.cat([gate[features], up[features]]))
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, features].clone(), group)
        mlp.intermediate_size = inter
    tied = model.lm_head.weight is model.embed_tokens.weight
    embed_rows, start = _vocab_shard(model.embed_tokens.weight, rank, size)
    model.embed_tokens = VocabParallelEmbedding(embed_rows, start, group)
    head_rows = model.embed_tokens.weight if tied else _vocab_shard(model.lm_head.weight, rank, size)[0]
    model.lm_head = VocabParallelLMHead(head_rows, cfg.vocab_size, group)
    # The local view: what this rank's attention, MLP and KV cache hold. vocab_size stays whole
    # (the logits are gathered), and so does hidden_size (every rank has whole hidden states).
    model.config = dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
    model.group = group
    return model
    # <<< week18: shard-model


def min_over_ranks(group: Group, value: int) -> int:
    """The smallest of every rank's value (KV pool sizes: the block tables must fit everywhere)."""
    if group.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())

