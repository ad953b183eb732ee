"""Week 23: LoRA adapters, many at once over one base model.

A LoRA adapter changes a linear layer y = x Wᵀ into y = x Wᵀ + s · (x Aᵀ) Bᵀ, with A [r, in] and
B [out, r] of a small rank r and a scale s (alpha / r). Merged into W, an adapter costs nothing,
but then the model serves that adapter alone. Kept apart, the two small products can differ per
row of a batch: requests of many adapters (and of none) share every step of one base model.

This file is the specification, in PyTorch:
- `read_adapter` reads an adapter in PEFT's format (`adapter_config.json` and
  `adapter_model.safetensors`) and checks it against the model, with one-line errors;
- `LoRALinear` wraps one of the model's linear layers (swapped in by `enable_lora`; the model code
  does not change). It holds every adapter slot's A and B in fixed buffers, and adds the low-rank
  products of each row's slot to the base output;
- `LoRARows` says which rows of a step use which slot (rows grouped by slot: the segments);
  `add_lora` is the reference of the two batched products (shrink: x Aᵀ, expand: · Bᵀ, added),
  which `nanoserve/kernels/lora.py` does in Triton.

Our attention fuses q, k and v into one `qkv_proj`, and the MLP gate and up into `gate_up_proj`.
An adapter's q_proj / k_proj / v_proj pieces become one adapter of the fused layer whose A is the
pieces' A stacked (rank r_q + r_k + r_v) and whose B is block-diagonal: each piece's B fills its own
output rows and rank columns, zeros elsewhere. (A checkpoint whose modules are fused already, PEFT
naming them `qkv_proj` / `gate_up_proj`, fills the whole layer with one piece.)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from nanoserve.model.config import ModelConfig

# Our adaptable layers: the module of a decoder layer that holds each, and the PEFT modules it fuses
# (each fills a slice of its output: `_slices`).
LAYERS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
          "o_proj": ("self_attn", ("o_proj",)),
          "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
          "down_proj": ("mlp", ("down_proj",))}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
TENSOR_NAME = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot run on this model (one line that says why): HTTP 400 at run time."""


@dataclass
class Piece:
    """One PEFT module's adapter inside one of our layers: rows `offset : offset + b.shape[0]` of its output."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [rows, r], the scale already multiplied in
    offset: int


@dataclass
class Adapter:
    """An adapter read from disk, on the host: for (layer index, our layer name), its pieces."""

    name: str
    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    pieces: dict[tuple[int, str], list[Piece]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for ps in self.pieces.values() for p in ps)


def _slices(config: ModelConfig, layer: str) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (first row, rows) of our layer's output it fills; fused names fill all."""
    if layer == "qkv_proj":
        q, kv = config.q_size, config.kv_size
        return {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv), "qkv_proj": (0, q + 2 * kv)}
    if layer == "gate_up_proj":
        inter = config.intermediate_size
        return {"gate_proj": (0, inter), "up_proj": (inter, inter), "gate_up_proj": (0, 2 * inter)}
    return {layer: (0, config.hidden_size)}


def _in_features(config: ModelConfig, layer: str) -> int:
    return {"o_proj": config.q_size, "down_proj": config.intermediate_size}.get(layer, config.hidden_size)


def our_layer(module: str) -> str:
    """The fused layer of ours a PEFT module name lands in (q_proj -> qkv_proj)."""
    return next(ours for ours, (_, names) in LAYERS.items() if module in names or module == ours)


def read_config(path: Path, max_rank: int, base_model: str | None) -> dict:
    """adapter_config.json, checked: a LoRA adapter whose every option we honour, rank ≤ max_rank."""
    file = path / "adapter_config.json"
    if not file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter: no adapter_config.json")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file} is not valid JSON: {e}") from None
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{path}: a {kind} adapter; nanoserve serves LoRA adapters only")
    refused = [(raw.get("use_dora"), "DoRA (use_dora)"), (raw.get("bias", "none") != "none", f"bias={raw.get('bias')!r}"),
               (raw.get("modules_to_save"), "modules_to_save"), (raw.get("fan_in_fan_out"), "fan_in_fan_out"),
               (raw.get("rank_pattern"), "per-module ranks (rank_pattern)"),
               (raw.get("alpha_pattern"), "per-module alphas (alpha_pattern)"), (raw.get("lora_bias"), "lora_bias"),
               (raw.get("layer_replication"), "layer_replication"),
               (raw.get("trainable_token_indices"), "trainable_token_indices"),
               (raw.get("alora_invocation_tokens"), "aLoRA (alora_invocation_tokens)")]
    for on, what in refused:
        if on:
            raise AdapterError(f"{path}: {what} is not supported; nanoserve serves plain LoRA adapters")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: adapter_config.json has no valid rank r ({rank!r})")
    if rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}; restart with a larger "
                           "--max-lora-rank")
    targets = raw.get("target_modules") or []
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise AdapterError(f"{path}: unknown target module(s) {', '.join(unknown)}; nanoserve adapts "
                               f"{', '.join(TARGETS[:7])}")
    theirs = raw.get("base_model_name_or_path")
    if _hub_id(theirs) and _hub_id(base_model) and theirs != base_model:
        raise AdapterError(f"{path}: made for base model {theirs}, this server runs {base_model}")
    return raw


def _hub_id(name: str | None) -> bool:
    """'org/name' that is no local path: only then do two names say whether two models differ."""
    return bool(name) and name.count("/") == 1 and not Path(name).expanduser().exists() \
        and not name.startswith((".", "/", "~"))


@torch.no_grad()
def read_adapter(path: str | Path, name: str, config: ModelConfig, max_rank: int,
                 base_model: str | None = None) -> Adapter:
    """Read and check a PEFT LoRA adapter for a model of `config`; raises AdapterError saying why not."""
    path = Path(path).expanduser()
    raw = read_config(path, max_rank, base_model)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"{path}: no adapter_model.safetensors (nanoserve reads safetensors adapters only)")
    rank, alpha = raw["r"], float(raw.get("lora_alpha", raw["r"]))
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    try:
        found = _read_tensors(path, weights, config)
    except (OSError, SafetensorError) as e:  # a truncated or corrupt file
        raise AdapterError(f"{weights} cannot be read: {e}") from None
    adapter = Adapter(name, str(path), rank, alpha, tuple(sorted({m for _, m in found})))
    for (layer, module), ab in sorted(found.items()):
        adapter.pieces.setdefault((layer, our_layer(module)), []).append(
            _piece(path, config, layer, module, ab, rank, scale))
    for (layer, ours), pieces in adapter.pieces.items():
        whole = _slices(config, ours)[ours][1]  # the layer's output rows: a piece of them all is a fused module's
        if len(pieces) > 1 and any(p.b.shape[0] == whole for p in pieces):
            raise AdapterError(f"{path}: layer {layer} adapts {ours} both whole and in parts (fused and split names)")
        pieces.sort(key=lambda p: p.offset)  # in the layer's order: q, k, v; gate, up
    return adapter



def _read_tensors(path: Path, weights: Path, config: ModelConfig) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """The adapter's tensors by (layer, PEFT module) and "A" / "B", every name checked."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for key in f.keys():
            match = TENSOR_NAME.search(key)
            if match is None or match.group(3) not in TARGETS:
                raise AdapterError(f"{path}: unknown target module in tensor {key}; nanoserve adapts "
                                   f"{', '.join(TARGETS[:7])}")
            layer, module = int(match.group(1)), match.group(3)
            if layer >= config.num_layers:
                raise AdapterError(f"{path}: tensor {key} is for layer {layer}; the base model has {config.num_layers}")
            found.setdefault((layer, module), {})[match.group(4)] = f.get_tensor(key).float()
    if not found:
        raise AdapterError(f"{path}: adapter_model.safetensors holds no LoRA tensors")
    return found


def _piece(path: Path, config: ModelConfig, layer: int, module: str, ab: dict[str, torch.Tensor], rank: int,
           scale: float) -> Piece:
    """One module's A and B, checked against the base model's shapes."""
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{path}: layer {layer} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
    ours = our_layer(module)
    offset, rows = _slices(config, ours)[module]
    want_a, want_b = (rank, _in_features(config, ours)), (rows, rank)
    if tuple(ab["A"].shape) != want_a or tuple(ab["B"].shape) != want_b:
        raise AdapterError(f"{path}: layer {layer} {module} has A {tuple(ab['A'].shape)} and B "
                           f"{tuple(ab['B'].shape)}; the base model wants {want_a} and {want_b} (another base model?)")
    return Piece(ab["A"], ab["B"] * scale, offset)


# ---------------------------------------------------------------------------- one step's rows


@dataclass
class LoRARows:
    """Which rows of a step use which adapter slot: slot s's rows are order[starts[s] : starts[s + 1]].

    Rows of no adapter are in no segment. In a CUDA graph `order` and `starts` are views of fixed
    buffers (written before each replay) and `groups` is None; eager steps also keep the non-empty
    segments on the host, as (slot, start, end), for the PyTorch path."""

    order: torch.Tensor  # [≥ rows with an adapter] int32
    starts: torch.Tensor  # [num_slots + 1] int32
    groups: list[tuple[int, int, int]] | None = None


def group_rows(slots: list[int], num_slots: int) -> tuple[list[int], list[int]]:
    """Per-row slots (-1: none) -> (rows grouped by slot, each slot's start in that list, and the end)."""
    # >>> week23: segments
    by_slot: list[list[int]] = [[] for _ in range(num_slots)]
    for row, slot in enumerate(slots):
        if slot >= 0:
            by_slot[slot].append(row)
    order, starts = [], [0]
    for rows in by_slot:
        order += rows
        starts.append(len(order))
    return order, starts
    # <<< week23: segments


def lora_rows(slots: list[int], num_slots: int, device: torch.device | str) -> LoRARows | None:
    """The LoRARows of an eager step (None when no row uses an adapter: the layers skip the products)."""
    if not any(s >= 0 for s in slots):
        return None
    order, starts = group_rows(slots, num_slots)
    groups = [(s, starts[s], starts[s + 1]) for s in range(num_slots) if starts[s + 1] > starts[s]]
    return LoRARows(torch.tensor(order, dtype=torch.int32, device=device),
                    torch.tensor(starts, dtype=torch.int32, device=device), groups)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: LoRARows) -> torch.Tensor:
    """y[i] += (x[i] A[s]ᵀ) B[s]ᵀ for every row i of slot s, in place; the reference of the kernels.

    y [T, out], x [T, in], a [slots, R, in], b [slots, out, R] (R: the buffers' rank, zero-padded)."""
    # >>> week23: lora-delta
    groups = rows.groups
    if groups is None:  # a CUDA graph's buffers (here on the CPU, where nothing is captured): read them
        starts = rows.starts.tolist()
        groups = [(s, starts[s], starts[s + 1]) for s in range(len(starts) - 1) if starts[s + 1] > starts[s]]
    for slot, start, end in groups:
        index = rows.order[start:end].long()
        shrunk = x[index] @ a[slot].T  # [n, R]: shrink
        y[index] += shrunk @ b[slot].T  # [n, out]: expand, added to the base output
    return y
    # <<< week23: lora-delta


# ---------------------------------------------------------------------------- the layers


class LoRAState:
    """What every LoRA layer of a model shares: this step's rows, and the function that adds the
    products (`add_lora`; `nanoserve.kernels.lora.use_lora_kernels` swaps the Triton one in)."""

    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.rows: LoRARows | None = None
        self.add = add_lora


class LoRALinear(nn.Module):
    """A linear layer plus one adapter per slot: base(x), plus each row's slot's low-rank product.

    The slots' weights live in fixed buffers (a CUDA graph reads them at fixed addresses): A
    [slots, R, in] and B [slots, out, R], R = max_rank × the pieces this layer fuses. A slot's
    adapter fills its first ranks; the rest stay zero, so adapters of several ranks share them."""

    def __init__(self, base: nn.Linear, state: LoRAState, num_pieces: int):
        super().__init__()
        self.base, self.state = base, state
        rank = state.max_rank * num_pieces
        w = base.weight
        self.register_buffer("lora_a", torch.zeros(state.max_loras, rank, w.shape[1], dtype=w.dtype, device=w.device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(state.max_loras, w.shape[0], rank, dtype=w.dtype, device=w.device),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight, as a Linear has it (week 12's `gate_up_silu` reads it, then sees
        that this is no plain product and runs the layer)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.base.weight, self.base.bias)
        rows = self.state.rows
        if rows is None:
            return y
        return self.state.add(y, x, self.lora_a, self.lora_b, rows)

    @torch.no_grad()
    def set_slot(self, slot: int, pieces: list[Piece]) -> None:
        """Write an adapter's pieces into `slot` (all zeros for none): A rows and B's diagonal blocks."""
        # >>> week23: fuse-pieces
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        first = 0  # the next free rank column
        for p in pieces:
            r, rows = p.a.shape[0], p.b.shape[0]
            self.lora_a[slot, first : first + r].copy_(p.a, non_blocking=True)
            self.lora_b[slot, p.offset : p.offset + rows, first : first + r].copy_(p.b, non_blocking=True)
            first += r
        # <<< week23: fuse-pieces


def enable_lora(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoRAState, dict[tuple[int, str], LoRALinear]]:
    """Swap a LoRA layer in for every adaptable linear layer of `model` (each decoder layer's
    qkv_proj, o_proj, gate_up_proj, down_proj); returns their shared state and the layers by (layer, name)."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be at least 1")
    state = LoRAState(max_loras, max_rank)
    layers: dict[tuple[int, str], LoRALinear] = {}
    for i, block in enumerate(model.layers):
        for name, (parent, pieces) in LAYERS.items():
            owner = getattr(block, parent)
            base = getattr(owner, name)
            if type(base) is not nn.Linear:
                raise ValueError(f"LoRA adapters need the model's plain linear layers; layer {i}'s {name} is a "
                                 f"{type(base).__name__}")
            layers[i, name] = LoRALinear(base, state, len(pieces))
            setattr(owner, name, layers[i, name])
    return state, layers
