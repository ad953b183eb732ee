"""Week 24: mixtures of experts. An MLP variant: many SwiGLU MLPs (the experts), a router that
sends each token to k of them, and the weighted sum of what those k return.

    x ─▶ router (a linear layer: one logit per expert) ─▶ softmax ─▶ top-k ─▶ weights w, experts e
    y = Σ_j w_j · expert_{e_j}(x)            (+ sigmoid(gate · x) · shared_expert(x), Qwen2-MoE)

Every token still costs k experts' worth of products, not all of them: a model with 8 experts of
which 2 run (Mixtral 8x7B) holds 47B parameters and computes like a 13B one. The families differ
in small rules: Mixtral rescales the k chosen probabilities to sum to 1, Qwen1.5-MoE keeps them
as the softmax over all experts gave them (`norm_topk_prob`), and adds a dense shared expert
through which every token goes, scaled by a sigmoid gate of its own.

The experts' weights live stacked, `w13` [E, 2I, H] (gate then up, as week 2's fused gate_up)
and `w2` [E, H, I], so that a kernel can reach any expert's weights from one pointer. The
checkpoint stores them one expert at a time, under each family's names: the loader fills
`ExpertWeights` modules by those names, and `finish_loading` stacks them (`MoEBlock.fuse_experts`).

How the experts run is the block's `kernel`: `experts_loop` below (the reference: for each expert,
gather its tokens, run its MLP, scatter the results back) or, on a GPU, the grouped kernels of
`nanoserve/kernels/moe.py`, swapped in with the other fused kernels. With expert parallelism
(`nanoserve/model/expert_parallel.py`) each rank holds some of the experts and `parallel` moves
the tokens to them and back. Nothing above the model layer knows that a model has experts, except
to read how many tokens each expert received (`expert_load`, for /metrics and the benchmarks).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import DecoderLayer
from nanoserve.model.llama import Llama

# A function that runs the experts: (x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k]) -> [T, H].
# An id equal to E names no expert (a padding row of expert parallelism's fixed-capacity dispatch): it runs
# nothing, and the output row of its token is not read.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), best first.

    Softmax over all experts in float32, keep the k largest probabilities, and (Mixtral) rescale
    them to sum to 1. Ties go to the lower expert id: a stable sort makes that a rule, where
    `torch.topk` leaves it unspecified (a router of zeros sends every token to experts 0..k-1).
    """
    # >>> week24: top-k-route
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
    # <<< week24: top-k-route


def combine(pair_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs [T * k, H] (token-major) -> their weighted sum [T, H], in float32,
    slot by slot in the same order everywhere (loop, kernel, expert parallelism)."""
    # >>> week24: moe-combine
    T, k = weights.shape
    return (pair_out.view(T, k, pair_out.shape[-1]).float() * weights[..., None]).sum(dim=1)
    # <<< week24: moe-combine


def experts_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """The reference: one expert at a time, its tokens gathered, its SwiGLU run, the results put
    back in their (token, slot) rows; then the weighted sum. x [T, H] -> [T, H] in x's dtype."""
    # >>> week24: expert-loop
    T, k = ids.shape
    inter = w2.shape[2]
    pair_out = x.new_zeros(T * k, x.shape[1])  # one row per (token, slot)
    flat = ids.flatten()  # [T * k]: pair p is token p // k, slot p % k
    for e in range(w13.shape[0]):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        gate, up = F.linear(x[pairs // k], w13[e]).split(inter, dim=-1)  # [n, I] each
        pair_out[pairs] = F.linear(F.silu(gate) * up, w2[e])
    return combine(pair_out, weights).to(x.dtype)
    # <<< week24: expert-loop


class ExpertWeights(nn.Module):
    """One expert's three projections under the checkpoint's names ("gate_proj", "up_proj",
    "down_proj"; Mixtral's "w1", "w3", "w2"): filled by the loader, then stacked."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, inter, bias=False))
        self.add_module(up, nn.Linear(hidden, inter, bias=False))
        self.add_module(down, nn.Linear(inter, hidden, bias=False))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate and up as one [2I, H], down [H, I])."""
        gate, up, down = (getattr(self, n).weight for n in self.names)
        return torch.cat([gate, up]), down


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense expert: a SwiGLU MLP every token goes through (projections as the checkpoint names them)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """The MLP of an MoE layer: router, experts, and (Qwen2-MoE) the gated shared expert."""

    def __init__(self, config: ModelConfig, expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.top_k, self.renormalize = config.num_experts, config.num_experts_per_tok, config.norm_topk_prob
        self.intermediate_size = inter
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)  # the router (its checkpoint name)
        self.experts = nn.ModuleList(ExpertWeights(hidden, inter, expert_names) for _ in range(config.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.w13 = self.w2 = None  # [E, 2I, H] and [E, H, I], once `fuse_experts` has run
        self.kernel: ExpertsFn | None = None  # nanoserve.kernels.moe.fused_moe, or None for `experts_loop`
        self.parallel = None  # expert parallelism: an `ExpertParallel` that moves tokens to the experts' ranks

    @torch.no_grad()
    def fuse_experts(self) -> None:
        """Stack the loaded experts into w13 and w2 (and drop the per-expert modules); start the load counter."""
        pieces = [expert.stacked() for expert in self.experts]
        self.w13 = nn.Parameter(torch.stack([gate_up for gate_up, _ in pieces]), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack([down for _, down in pieces]), requires_grad=False)
        del self.experts
        # Token-expert pairs routed to each expert since the last reset: counted on the device, in
        # place (a CUDA graph replays the add), read only when someone asks (`expert_load`).
        self.register_buffer("load", torch.zeros(self.num_experts, dtype=torch.long, device=self.w13.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        self.load.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        if self.parallel is not None:
            out = self.parallel(x, weights, ids, self.run_experts)
        else:
            out = self.run_experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts this block holds, on rows routed to them (ids: indices into w13 and w2)."""
        return (self.kernel or experts_loop)(x, self.w13, self.w2, weights, ids)


class MoEDecoderLayer(DecoderLayer):
    """Week 2's block, its MLP a mixture of experts where the config says (Qwen2-MoE keeps some dense)."""

    expert_names = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoEBlock(config, self.expert_names)


class MixtralDecoderLayer(MoEDecoderLayer):
    """Mixtral's checkpoints call the block `block_sparse_moe` and the projections w1 (gate), w3
    (up), w2 (down): the block is loaded under that name, then filed under `mlp` (`finish_loading`)."""

    expert_names = ("w1", "w3", "w2")

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.block_sparse_moe = self.mlp
        del self.mlp


class MoEModel(Llama):
    """Qwen2-MoE: Llama with MoE layers (Qwen2's attention biases come with the config)."""

    layer_class = MoEDecoderLayer

    def finish_loading(self) -> None:
        for block in moe_blocks(self):
            block.fuse_experts()


class Mixtral(MoEModel):
    layer_class = MixtralDecoderLayer

    def finish_loading(self) -> None:
        for layer in self.layers:
            block = layer.block_sparse_moe
            del layer.block_sparse_moe
            layer.mlp = block
        super().finish_loading()


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks, in layer order ([] for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def expert_load(model: Llama) -> dict[int, list[int]] | None:
    """Token-expert pairs each expert received since the last reset, by layer index (MoE layers
    only; None: a dense model). Reading waits for the device. Under expert parallelism every rank
    routes every token of a step (it dispatches only its share), so one rank's counts are all ranks'.
    On a GPU with CUDA graphs the padding rows of a padded decode step count too: they go through
    the experts like the others."""
    load = {i: layer.mlp.load.tolist() for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)}
    return load or None


def reset_expert_load(model: nn.Module) -> None:
    """Zero the counters (in place: a captured CUDA graph keeps adding into the same memory)."""
    for block in moe_blocks(model):
        block.load.zero_()


def check_moe_supported(model: nn.Module, quantization: str | None, lora: bool) -> None:
    """Refuse what mixtures of experts do not take yet, by name."""
    if not moe_blocks(model):
        return
    if quantization is not None:
        raise ValueError(f"--quantization {quantization} is not supported for mixtures of experts yet (the experts' "
                         "stacked weights would stay unquantized)")
    if lora:
        raise ValueError("LoRA adapters on a mixture of experts are not supported yet")

