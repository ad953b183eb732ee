"""Week 23's fixtures: a tiny random checkpoint and PEFT adapters made on it (random A and B, B
non-zero so every adapter changes the outputs), with HF + PEFT as the reference."""

import contextlib
import copy
import warnings
from pathlib import Path

import pytest
import torch

from nanoserve.testing import make_checkpoint, tiny_config

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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(checkpoint directory, HF model) of a tiny random Llama."""
    return make_checkpoint(tmp_path_factory.mktemp("lora_base"), tiny_config(num_hidden_layers=3))


@pytest.fixture(scope="session")
def adapters(tiny, tmp_path_factory):
    """Four adapters of several ranks and target sets, by name."""
    path, hf = tiny
    root = tmp_path_factory.mktemp("adapters")
    specs = {"attn8": (8, ATTENTION, 1), "mlp4": (4, MLP, 2), "all16": (16, ATTENTION + MLP, 3), "qv2": (2, ["q_proj", "v_proj"], 4)}
    return {name: make_adapter(hf, root / name, r, targets, seed) for name, (r, targets, seed) in specs.items()}
