"""Week 2: the per-layer debugger finds the first layer that diverges."""

import pytest
import torch

from nanoserve.cli import main
from nanoserve.bench.compare import compare_with_hf, first_divergence, format_report
from nanoserve.model.loader import load_model
from nanoserve.testing import make_checkpoint, tiny_config

pytestmark = pytest.mark.exercise("model-forward")


def test_agreeing_models(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=3))
    diffs = compare_with_hf(str(path), list(range(5, 25)))
    assert [d.name for d in diffs] == ["embeddings", "layer 0", "layer 1", "final norm", "logits"]
    assert first_divergence(diffs) is None
    assert "all stages agree" in format_report(diffs)


def test_names_the_first_broken_layer(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=3))
    broken = load_model(path)
    with torch.no_grad():  # a bug in layer 1's MLP: everything before it still matches
        broken.layers[1].mlp.down_proj.weight.mul_(1.01)
    diffs = compare_with_hf(str(path), list(range(5, 25)), ours=broken)
    assert first_divergence(diffs).name == "layer 1"
    assert "first divergence: layer 1" in format_report(diffs)


def test_cli_compare_exit_code(tmp_path, capsys):
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config())
    assert main(["compare", "--model", str(path), "hello world"]) == 0
    assert "all stages agree" in capsys.readouterr().out
