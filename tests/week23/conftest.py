"""Week 23's fixtures: a tiny random checkpoint and PEFT adapters made on it (random A and B, B
non-zero so every adapter changes the outputs), with HF + PEFT as the reference."""

import pytest

from nanoserve.testing import make_checkpoint, tiny_config

pytest.importorskip("peft", reason="week 23's tests make their adapters with peft: pip install peft")

from lora_helpers import ATTENTION, MLP, make_adapter  # noqa: E402


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
