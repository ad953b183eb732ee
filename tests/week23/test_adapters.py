"""Week 23: adapters in PEFT's format, read and checked. Everything an adapter can get wrong is a
one-line error at load (an `AdapterError`, a ValueError), naming what to do."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import ATTENTION, MLP, hf_greedy, make_adapter
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.model.lora import AdapterError, read_adapter
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import make_hf_model, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [1, 45, 802, 13, 99, 7, 1200, 64, 3000]


def edited(src, dst, **changes):
    """A copy of adapter `src` with its adapter_config.json changed."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def config(tiny):
    return ModelConfig.from_json(tiny[0])


def test_an_adapter_reads_into_our_fused_layers(adapters, config):
    adapter = read_adapter(adapters["all16"], "all16", config, max_rank=16)
    assert (adapter.rank, adapter.alpha) == (16, 32.0)
    assert set(adapter.targets) == set(ATTENTION + MLP)
    assert {name for _, name in adapter.pieces} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    q, k, v = adapter.pieces[0, "qkv_proj"]  # q's rows first, then k's, then v's
    assert (q.offset, k.offset, v.offset) == (0, config.q_size, config.q_size + config.kv_size)
    raw = load_file(adapters["all16"] / "adapter_model.safetensors")
    b = raw["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert torch.equal(k.b, b * 2.0)  # the scale alpha / r folded into B


@pytest.mark.parametrize("change,message", [
    (dict(r=32), "rank 32 is above --max-lora-rank 16"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "unknown target module"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias='all'"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="PREFIX_TUNING"), "LoRA adapters only"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(base_model_name_or_path="someone/other-model"), "made for base model someone/other-model"),
])
def test_a_bad_config_is_one_line(adapters, config, tmp_path, change, message):
    bad = edited(adapters["attn8"], tmp_path / "bad", **change)
    with pytest.raises(AdapterError, match=message) as e:
        read_adapter(bad, "bad", config, max_rank=16, base_model="meta-llama/Llama-3.2-1B")
    assert "\n" not in str(e.value)


def test_an_adapter_of_another_base_model_is_refused(tiny, tmp_path, config):
    other = make_hf_model(tiny_config(hidden_size=96, num_hidden_layers=3))  # same names, other shapes
    path = make_adapter(other, tmp_path / "other", 4, ["q_proj"], seed=1)
    with pytest.raises(AdapterError, match=r"layer 0 q_proj has A \(4, 96\).*wants \(4, 64\).*another base model"):
        read_adapter(path, "other", config, max_rank=16)
    deeper = make_hf_model(tiny_config(num_hidden_layers=4))
    path = make_adapter(deeper, tmp_path / "deeper", 4, ["o_proj"], seed=1)
    with pytest.raises(AdapterError, match="for layer 3; the base model has 3"):
        read_adapter(path, "deeper", config, max_rank=16)


def test_unknown_tensors_and_broken_files_are_refused(adapters, config, tmp_path):
    src = adapters["qv2"]
    bad = edited(src, tmp_path / "lm_head")
    tensors = load_file(src / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(2, 64)
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="unknown target module in tensor base_model.model.lm_head"):
        read_adapter(bad, "x", config, max_rank=16)
    half = edited(src, tmp_path / "half")
    tensors = load_file(src / "adapter_model.safetensors")
    del tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(tensors, half / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="layer 1 v_proj has lora_B missing"):
        read_adapter(half, "x", config, max_rank=16)
    corrupt = edited(src, tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="cannot be read"):
        read_adapter(corrupt, "x", config, max_rank=16)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path, "x", config, max_rank=16)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_adapter(tmp_path / "empty", "x", config, max_rank=16)


def test_the_engine_refuses_at_load(tiny, adapters, tmp_path):
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        LLM(str(tiny[0]), device="cpu", lora_modules={"all16": str(adapters["all16"])}, max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank is set but LoRA is off"):
        LLM(str(tiny[0]), device="cpu", max_lora_rank=8)
    llm = LLM(str(tiny[0]), device="cpu", max_loras=1, max_lora_rank=8)  # LoRA on, no adapter yet
    with pytest.raises(ValueError, match="unknown adapter 'attn8'; loaded: none"):
        llm.generate(PROMPT, GREEDY, lora="attn8")
    with pytest.raises(ValueError, match="rank 16 is above"):
        llm.add_lora("all16", adapters["all16"])
    llm.add_lora("attn8", adapters["attn8"])
    with pytest.raises(ValueError, match="adapter name 'attn8' is taken"):
        llm.add_lora("attn8", adapters["qv2"])
    with pytest.raises(ValueError, match="no LoRA layers"):
        LLM(str(tiny[0]), device="cpu").add_lora("attn8", adapters["attn8"])


def test_rslora_scales_by_the_square_root(tiny, tmp_path):
    _, hf = tiny
    path = make_adapter(hf, tmp_path / "rs", 9, ["v_proj", "down_proj"], seed=7, alpha=6, use_rslora=True)
    llm = LLM(str(tiny[0]), device="cpu", lora_modules={"rs": str(path)})
    assert llm.generate(PROMPT, GREEDY, lora="rs")[0].token_ids == hf_greedy(hf, path, PROMPT, 8)


def test_peft_names_of_fused_modules(tiny, tmp_path):
    """A model whose projections are fused already (Phi-3's qkv_proj, gate_up_proj) has PEFT adapters
    on the fused modules: one A and one B for all of q, k and v. Such an adapter equals separate q, k,
    v (and gate, up) adapters that share one A, whose B's are the fused B's rows: HF + PEFT runs the latter."""
    _, hf = tiny
    separate = make_adapter(hf, tmp_path / "separate", 4, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], seed=9)
    tensors = load_file(separate / "adapter_model.safetensors")
    fused = {}
    for layer in range(3):
        for group, parts in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            name = f"base_model.model.model.layers.{layer}.{group}."
            shared = tensors[name + parts[0] + ".lora_A.weight"]
            for part in parts:
                tensors[name + part + ".lora_A.weight"] = shared.clone()
            ours = "qkv_proj" if group == "self_attn" else "gate_up_proj"
            fused[name + ours + ".lora_A.weight"] = shared.clone()
            fused[name + ours + ".lora_B.weight"] = torch.cat([tensors[name + p + ".lora_B.weight"] for p in parts])
    save_file(tensors, separate / "adapter_model.safetensors")
    fused_dir = edited(separate, tmp_path / "fused", target_modules=["qkv_proj", "gate_up_proj"])
    save_file(fused, fused_dir / "adapter_model.safetensors")
    llm = LLM(str(tiny[0]), device="cpu", lora_modules={"fused": str(fused_dir), "separate": str(separate)})
    expected = hf_greedy(hf, separate, PROMPT, 8)
    assert llm.generate(PROMPT, GREEDY, lora="fused")[0].token_ids == expected
    assert llm.generate(PROMPT, GREEDY, lora="separate")[0].token_ids == expected


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_adapters_on_other_families(tmp_path, family):
    """Week 19's families adapt the same layers: Qwen2's biased q/k/v (the bias stays the base's),
    Gemma 3's GELU MLP, q/k norms and sliding windows."""
    from nanoserve.testing import make_family_checkpoint

    path, hf = make_family_checkpoint(tmp_path / family, family)
    adapter = make_adapter(hf, tmp_path / "adapter", 4, ATTENTION + MLP, seed=11, std=0.1)
    llm = LLM(str(path), device="cpu", lora_modules={"a": str(adapter)})
    prompt = PROMPT + [17, 23, 501, 9]  # past Gemma's window of 8
    assert llm.generate(prompt, GREEDY, lora="a")[0].token_ids == hf_greedy(hf, adapter, prompt, 8)


def test_fused_and_split_names_of_one_layer_are_refused(adapters, config, tmp_path):
    both = edited(adapters["qv2"], tmp_path / "both")
    tensors = load_file(adapters["qv2"] / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.qkv_proj."
    tensors[name + "lora_A.weight"] = torch.zeros(2, 64)
    tensors[name + "lora_B.weight"] = torch.zeros(config.q_size + 2 * config.kv_size, 2)
    save_file(tensors, both / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="layer 0 adapts qkv_proj both whole and in parts"):
        read_adapter(both, "both", config, max_rank=16)


def test_what_lora_does_not_combine_with_is_refused_at_once():
    from nanoserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor and pipeline parallelism do not take them yet"):
        EngineConfig(max_loras=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor and pipeline parallelism do not take them yet"):
        EngineConfig(lora_modules={"a": "/x"}, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="LoRA adapters with --quantization are not supported yet"):
        EngineConfig(max_loras=1, quantization="int8")
    with pytest.raises(ValueError, match="at least one device slot"):
        EngineConfig(lora_modules={"a": "/x"}, max_loras=0)
    assert (EngineConfig(lora_modules={"a": "/x"}).max_loras, EngineConfig().max_loras) == (4, 0)
    assert EngineConfig(max_loras=2).max_lora_rank == 16
