"""Week 23's test helpers: PEFT adapters made in the test, and HF + PEFT's greedy tokens.

A module of its own, not conftest.py: two weeks' conftest files share one module name, so a test
that imported from `conftest` could get the other week's."""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="week 23's tests make their adapters with peft: pip install peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base, path: Path, r: int, targets: list[str], seed: int, alpha: float | None = None,
                 std: float = 0.25, **config) -> Path:
    """Save a PEFT LoRA adapter of `base` (a HF model, left unchanged) with seeded random A and B."""
    with quiet():
        model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=targets,
                                                          lora_dropout=0.0, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    with quiet():
        model.save_pretrained(path)
    model.unload()  # the base model's own modules back, for the next adapter
    return path


@contextlib.contextmanager
def quiet():
    """A context without transformers' own deprecation warning, which peft's calls raise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)  # GGUF's folder
        yield


def hf_greedy(base, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """HF transformers (+ PEFT with the adapter) greedy, the reference: n tokens, EOS or not, as
    nanoserve's `ignore_eos` (`min_new_tokens` would forbid EOS instead), every prompt token
    attended (no attention mask guessed from a pad token)."""
    with quiet():
        model = base if adapter is None else peft.PeftModel.from_pretrained(base, str(adapter))
    config = copy.deepcopy(base.generation_config)
    config.update(eos_token_id=None, pad_token_id=0, do_sample=False, max_new_tokens=n, min_new_tokens=None)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             generation_config=config)
    if adapter is not None:
        model.unload()
    return out[0, len(prompt):].tolist()
