"""The per-layer debugger: run nanoserve and HuggingFace side by side, layer by layer.

When week 2's tests fail, the final logits are wrong but they do not say *where* things went
wrong. This tool feeds the same tokens to both models and prints the largest difference after
the embeddings, after every decoder layer, after the final norm and in the logits, and names
the first place where the difference exceeds the tolerance.

    nanoserve compare --model tiny "The list"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.model.llama import Llama
from nanoserve.model.loader import gguf_source, load_model, resolve_model_dir


@dataclass
class LayerDiff:
    name: str  # "embeddings", "layer 0", ..., "final norm", "logits"
    max_abs_diff: float
    scale: float  # the largest |value| in HF's tensor, to judge the difference against

    def ok(self, rtol: float) -> bool:
        return self.max_abs_diff <= rtol * max(1.0, self.scale)


@torch.no_grad()
def compare_with_hf(model: str, input_ids: list[int], ours: Llama | None = None) -> list[LayerDiff]:
    """Differences between nanoserve and HF (both float32) at every stage of the forward pass, for
    any family (week 19): HF's class is the one the checkpoint's config names. For a GGUF file HF
    reads the file itself (its own GGUF loader), not nanoserve's conversion of it: the comparison
    then covers the converter too."""
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(model)
    source = gguf_source(model)
    if source is not None:
        hf = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.eval()
    ours = ours if ours is not None else load_model(model_dir, dtype=torch.float32)
    ids = torch.tensor(input_ids)
    expected = hf(ids[None], output_hidden_states=True)
    theirs = [h[0] for h in expected.hidden_states]  # embeddings, layers 0..n-2, final norm

    states: list[torch.Tensor] = []
    hidden = ours(ids, torch.arange(len(ids)), PrefillContext([len(ids)]), hidden_states_out=states)
    n_layers = ours.config.num_layers
    pairs = [("embeddings", states[0], theirs[0])]
    pairs += [(f"layer {i}", states[i + 1], theirs[i + 1]) for i in range(n_layers - 1)]
    # HF returns the last layer's output only after the final norm; compare it there.
    pairs += [("final norm", hidden, theirs[-1])]
    pairs += [("logits", ours.compute_logits(hidden), expected.logits[0].float())]
    return [LayerDiff(name, (a - b).abs().max().item(), b.abs().max().item()) for name, a, b in pairs]


def first_divergence(diffs: list[LayerDiff], rtol: float = 1e-4) -> LayerDiff | None:
    return next((d for d in diffs if not d.ok(rtol)), None)


def format_report(diffs: list[LayerDiff], rtol: float = 1e-4) -> str:
    lines = [f"{'stage':<12} {'max |ours - hf|':>16} {'max |hf|':>10}  verdict"]
    for d in diffs:
        lines.append(f"{d.name:<12} {d.max_abs_diff:>16.3e} {d.scale:>10.3g}  {'ok' if d.ok(rtol) else 'DIFFERS'}")
    bad = first_divergence(diffs, rtol)
    if bad is None:
        lines.append(f"all stages agree (relative tolerance {rtol:g})")
    else:
        lines.append(f"first divergence: {bad.name}. Look there first: everything before it matches.")
        if bad.name.startswith("layer"):
            lines.append("(a layer's output includes RoPE, attention, the MLP and both of its norms)")
    return "\n".join(lines)
