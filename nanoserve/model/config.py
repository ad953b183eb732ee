"""Week 1: the model's shapes and hyperparameters, read from a HuggingFace `config.json`.

Everything the model needs to know about its own shape lives in one frozen dataclass,
`ModelConfig`. We read it from the `config.json` that every HuggingFace checkpoint carries, and
we refuse, with a message naming the problem, anything we do not know how to run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ConfigError(ValueError):
    """A `config.json` that nanoserve cannot run (wrong architecture, missing or bad field)."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency scaling for rotary embeddings (`rope_type: "llama3"`)."""

    factor: float  # how much longer the context became (32 for Llama-3.2)
    low_freq_factor: float  # wavelengths longer than original_max / low_freq_factor are divided by factor
    high_freq_factor: float  # wavelengths shorter than original_max / high_freq_factor are untouched
    original_max_position_embeddings: int  # the context length the model was first trained at


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"  # the dtype the checkpoint was saved in

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        # >>> week01: config-from-dict
        architectures = raw.get("architectures") or []
        # A config without "architectures" still names its family in "model_type".
        is_llama = any(a in SUPPORTED_ARCHITECTURES for a in architectures) or (
            not architectures and raw.get("model_type") == "llama"
        )
        if not is_llama:
            architectures = architectures or [raw.get("model_type", "unknown")]
            raise ConfigError(
                f"unsupported architecture {architectures}: nanoserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints (config.json 'architectures')"
            )

        def need(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"config.json is missing the required field '{name}'")
            return raw[name]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads != 0:
            raise ConfigError(
                f"num_attention_heads ({num_heads}) must be a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias are not supported (Llama has no biases)")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"hidden_act '{hidden_act}' is not supported (Llama uses 'silu')")

        rope_theta, rope_scaling = _read_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Older configs say "torch_dtype", newer ones "dtype".
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(dtype),
        )
        # <<< week01: config-from-dict

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json at {path}: is this a HuggingFace checkpoint directory?")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _read_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope theta and llama3 scaling from either config format.

    transformers < 5 writes `rope_theta` plus an optional `rope_scaling` dict; transformers >= 5
    writes one `rope_parameters` dict holding `rope_theta` and the scaling keys together.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = raw.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ConfigError("config.json is missing the required field 'rope_theta'")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"rope scaling type '{rope_type}' is not supported (only 'llama3')")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope scaling is missing the field {e.args[0]!r}") from None
    return float(theta), scaling


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not fit the model: missing, unexpected or misshapen."""

