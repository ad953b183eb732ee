"""Week 1: loading HuggingFace checkpoints (single file, sharded, tied, untied) and their errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.model.config import CheckpointError
from nanoserve.model.loader import checkpoint_files, hf_to_nanoserve, load_model, resolve_model_dir
from nanoserve.testing import make_checkpoint, tiny_config


def assert_same_weights(ours, hf):
    """Every HF tensor equals the matching (slice of the) nanoserve parameter."""
    params = dict(ours.named_parameters())
    hf_state = hf.state_dict()
    checked = 0
    for hf_name, tensor in hf_state.items():
        if hf_name == "lm_head.weight" and hf.config.tie_word_embeddings:
            assert ours.lm_head.weight is ours.embed_tokens.weight
            continue
        name, shard = hf_to_nanoserve(hf_name)
        p = params[name]
        if shard is None:
            assert torch.equal(p, tensor), hf_name
        else:
            cfg = ours.config
            sizes = ([cfg.q_size, cfg.kv_size, cfg.kv_size] if "qkv" in name
                     else [cfg.intermediate_size] * 2)
            start = sum(sizes[:shard])
            assert torch.equal(p[start : start + sizes[shard]], tensor), hf_name
        checked += 1
    assert checked == len(hf_state) - int(hf.config.tie_word_embeddings)


@pytest.mark.exercise("name-mapping")
def test_name_mapping():
    assert hf_to_nanoserve("model.layers.3.self_attn.k_proj.weight") == ("layers.3.self_attn.qkv_proj.weight", 1)
    assert hf_to_nanoserve("model.layers.0.mlp.up_proj.weight") == ("layers.0.mlp.gate_up_proj.weight", 1)
    assert hf_to_nanoserve("model.layers.0.mlp.down_proj.weight") == ("layers.0.mlp.down_proj.weight", None)
    assert hf_to_nanoserve("model.embed_tokens.weight") == ("embed_tokens.weight", None)
    assert hf_to_nanoserve("lm_head.weight") == ("lm_head.weight", None)


@pytest.mark.exercise("load-weights")
@pytest.mark.parametrize("tied", [True, False])
def test_single_file_checkpoint_loads_exactly(tmp_path, tied):
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config(tie_word_embeddings=tied))
    assert checkpoint_files(path) == [path / "model.safetensors"]
    ours = load_model(path)
    assert_same_weights(ours, hf)
    if not tied:
        assert ours.lm_head.weight is not ours.embed_tokens.weight


@pytest.mark.exercise("load-weights")
def test_sharded_checkpoint_loads_exactly(tmp_path):
    path, hf = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=4), max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").exists()
    assert len(checkpoint_files(path)) > 1
    assert_same_weights(load_model(path), hf)


@pytest.mark.exercise("load-weights")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_is_the_callers_choice(tmp_path, dtype):
    path, hf = make_checkpoint(tmp_path / "ckpt")
    ours = load_model(path, dtype=dtype, device="cpu")
    assert all(p.dtype == dtype for p in ours.parameters())
    assert all(p.device.type == "cpu" for p in ours.parameters())
    torch.testing.assert_close(ours.embed_tokens.weight, hf.model.embed_tokens.weight.to(dtype))


def _rewrite(path, change):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.exercise("load-weights")
def test_missing_tensor_is_named(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt")
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_model(path)


@pytest.mark.exercise("load-weights")
def test_missing_norm_is_named(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt")
    _rewrite(path, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_model(path)


@pytest.mark.exercise("load-weights")
def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(tie_word_embeddings=False))
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(path)


@pytest.mark.exercise("load-weights")
def test_unexpected_tensor_is_named(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_model(path)


@pytest.mark.exercise("load-weights")
def test_shape_mismatch_is_named(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt")

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
        t["model.layers.1.input_layernorm.weight"] = t["model.layers.1.input_layernorm.weight"]

    _rewrite(path, shrink)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        load_model(path)


@pytest.mark.exercise("load-weights")
def test_shape_mismatch_with_config(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = 96  # the weights were made for 64
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(path)


def test_no_weights_at_all(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path)


def test_missing_shard_is_named(tmp_path):
    path, _ = make_checkpoint(tmp_path / "ckpt", tiny_config(num_hidden_layers=4), max_shard_size="200KB")
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(path)


def test_bad_model_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        resolve_model_dir(str(tmp_path / "does-not-exist"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a GGUF file.*takes a model folder"):
        resolve_model_dir(tmp_path / "file.txt")


def test_hub_id_offline_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="hf auth login"):
        resolve_model_dir("nanoserve-tests/definitely-not-a-real-repo")
