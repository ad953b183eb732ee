"""Week 1: the model's shapes and hyperparameters, read from a HuggingFace `config.json`.

Everything the model needs to know about its own shape lives in one frozen dataclass,
`ModelConfig`. We read it from the `config.json` that every HuggingFace checkpoint carries, and
we refuse, with a message naming the problem, anything we do not know how to run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# The families nanoserve runs (week 19: `nanoserve/model/registry.py` maps each to its model class),
# and the `model_type` that names each in a config without "architectures".
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",  # week 24: mixtures of experts
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES.values())
FULL, SLIDING = "full_attention", "sliding_attention"  # the kinds of layer, as HF's `layer_types` names them


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
    # Week 19: what the families change, with Llama's values as defaults (`_family_options` reads them).
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False  # Qwen2: q, k and v projections have biases
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and of k, before RoPE
    hidden_act: str = "silu"  # the MLP's gate activation; Gemma: "gelu_pytorch_tanh"
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; () means every layer is FULL
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of its sliding layers
    query_pre_attn_scalar: float | None = None  # Gemma 3: softmax scale is this ** -0.5, not head_dim ** -0.5
    # Week 24: a mixture of experts in place of the MLP (`_moe_options` reads them; 0 experts: a dense model).
    num_experts: int = 0  # experts of each MoE layer
    num_experts_per_tok: int = 0  # the k of top-k: experts each token goes through
    moe_intermediate_size: int = 0  # the features of one expert's SwiGLU
    norm_topk_prob: bool = True  # rescale the k chosen probabilities to sum to 1 (Mixtral: yes; Qwen1.5-MoE: no)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token goes through, sigmoid-gated
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (intermediate_size) instead of experts

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Week 24: whether this layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer_idx not in self.dense_layers

    def window(self, layer_idx: int) -> int | None:
        """The sliding window of one layer, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:  # Mistral: a window names no layer kinds, and every layer slides
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    @property
    def attention_scale(self) -> float | None:
        """The softmax scale when it is not head_dim ** -0.5 (None: the default)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        # >>> week01: config-from-dict
        architectures = raw.get("architectures") or []
        # A config without "architectures" still names its family in "model_type".
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not architectures and raw.get("model_type") in MODEL_TYPES:
            supported = [MODEL_TYPES[raw["model_type"]]]
        if not supported:
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
        rope_theta, rope_scaling = _read_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Older configs say "torch_dtype", newer ones "dtype".
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        config = cls(
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
        return _family_options(config, raw)

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
    if FULL in params:  # transformers >= 5 for Gemma 3: one entry per kind of layer (the sliding one: below)
        params = params[FULL]
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



# ---------------------------------------------------------------------------- week 19: the families


def _layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """FULL or SLIDING for each layer, from `layer_types` (newer configs) or what older ones say."""
    types = raw.get("layer_types")
    if types is None and raw.get("sliding_window_pattern"):  # Gemma 3 before transformers 5: every Nth is full
        pattern = int(raw["sliding_window_pattern"])
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if types is None and raw.get("use_sliding_window"):  # Qwen2/3: layers from max_window_layers on slide
        first = int(raw.get("max_window_layers") or 0)
        types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    if types is None:
        return ()
    if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise ConfigError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of the {num_layers} layers")
    return tuple(types)


def _refuse_what_llama_lacks(raw: dict[str, Any]) -> None:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("attention_bias / mlp_bias are not supported (Llama has no biases)")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"hidden_act '{hidden_act}' is not supported (Llama uses 'silu')")


def _family_options(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """What the checkpoint's family changes in a Llama, read from its config.json; anything a family
    has that nanoserve does not run is refused by name. (`from_dict` has checked the architecture.)"""
    named = [a for a in raw.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES]
    architecture = named[0] if named else MODEL_TYPES[raw["model_type"]]
    if architecture == "LlamaForCausalLM":  # the defaults are Llama's: nothing to read
        _refuse_what_llama_lacks(raw)
        return config
    if architecture in MOE_ARCHITECTURES:  # week 24
        return _moe_options(config, raw, architecture)
    # >>> week19: family-options
    options: dict[str, Any] = {"architecture": architecture}
    if architecture == "MistralForCausalLM":
        _refuse_what_llama_lacks(raw)
        if raw.get("sliding_window"):
            options["sliding_window"] = int(raw["sliding_window"])  # every layer slides
    elif architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        options["attention_bias"] = architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias"))
        options["qk_norm"] = architecture == "Qwen3ForCausalLM"
        options["layer_types"] = _layer_types(raw, config.num_layers)
        if SLIDING in options["layer_types"]:
            options["sliding_window"] = int(raw["sliding_window"])
    elif architecture == "Gemma3ForCausalLM":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(name) is not None:
                raise ConfigError(f"{name} is not supported (Gemma 3 has none; Gemma 2 does)")
        if raw.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention is not supported (a causal language model is)")
        local = (raw.get("rope_parameters") or {}).get(SLIDING, {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"rope type {local['rope_type']!r} of the sliding layers is not supported")
        options.update(
            qk_norm=True,
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
            sliding_window=int(raw.get("sliding_window") or 4096),
            layer_types=_layer_types({"sliding_window_pattern": 6, **raw}, config.num_layers),
            rope_local_theta=float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or config.head_dim),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )
    if options.get("hidden_act", "silu") not in ("silu", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation {options['hidden_act']!r} is not supported ('silu', 'gelu_pytorch_tanh')")
    return replace(config, **options)
    # <<< week19: family-options


# ---------------------------------------------------------------------------- week 24: mixtures of experts


def _moe_options(config: ModelConfig, raw: dict[str, Any], architecture: str) -> ModelConfig:
    """Mixtral: Mistral's attention, every MLP a softmax router over `num_local_experts` experts,
    top-k renormalized. Qwen2-MoE: Qwen2's attention (q/k/v biases), many small experts whose top-k
    probabilities are kept as they are unless `norm_topk_prob`, a sigmoid-gated shared expert, and
    dense layers where `mlp_only_layers` or `decoder_sparse_step` say so."""
    def need(name: str) -> int:
        if not raw.get(name):
            raise ConfigError(f"config.json of a {architecture} checkpoint is missing '{name}'")
        return int(raw[name])

    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported for experts (they run SwiGLU: 'silu')")
    options: dict[str, Any] = {"architecture": architecture, "num_experts_per_tok": need("num_experts_per_tok")}
    if architecture == "MixtralForCausalLM":
        _refuse_what_llama_lacks(raw)
        options.update(num_experts=need("num_local_experts"), moe_intermediate_size=config.intermediate_size)
        if raw.get("sliding_window"):
            options["sliding_window"] = int(raw["sliding_window"])  # every layer slides, as Mistral's
    else:
        step = int(raw.get("decoder_sparse_step") or 1)
        sparse = [i for i in range(config.num_layers)
                  if i not in (raw.get("mlp_only_layers") or []) and (i + 1) % step == 0]
        options.update(num_experts=need("num_experts"), moe_intermediate_size=need("moe_intermediate_size"),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", False)), attention_bias=bool(raw.get("qkv_bias", True)),
                       shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                       dense_layers=tuple(i for i in range(config.num_layers) if i not in sparse),
                       layer_types=_layer_types(raw, config.num_layers))
        if SLIDING in options["layer_types"]:
            options["sliding_window"] = int(raw["sliding_window"])
    if not 0 < options["num_experts_per_tok"] <= options["num_experts"]:
        raise ConfigError(f"num_experts_per_tok ({options['num_experts_per_tok']}) must be between 1 and the "
                          f"number of experts ({options['num_experts']})")
    return replace(config, **options)
