"""Week 19: the model families a GGUF file may hold, and how llama.cpp stores each of them.

`gguf.py` converts a GGUF file into a HuggingFace checkpoint directory. What differs between the
families lives here: the config.json fields each HF class needs, llama.cpp's tensor names beyond
Llama's, which families llama.cpp stores in its own layouts, and the chat format of a family whose
files carry none.

    general.architecture   HF class            model_type     files
    llama                  LlamaForCausalLM    llama          Llama 2/3, SmolLM2, Mistral (stored as "llama")
    qwen2                  Qwen2ForCausalLM    qwen2          Qwen2, Qwen2.5
    qwen3                  Qwen3ForCausalLM    qwen3          Qwen3 (dense)
    gemma3                 Gemma3ForCausalLM   gemma3_text    Gemma 3 (text), e.g. gemma-3-270m

Two storage conventions of llama.cpp's converter, checked against llama.cpp and against
transformers' own GGUF loader (`transformers.modeling_gguf_pytorch_utils`: its `TENSOR_PROCESSORS`):

- Q/K rows permuted: only for `llama`. llama.cpp's RoPE for llama is "normal" (neighbouring
  channels 2i, 2i+1 turn together), so its converter reorders q_proj/k_proj rows; for qwen2,
  qwen3 and gemma3 llama.cpp's RoPE is "neox" (channel i with i + head_dim/2), HF's own layout,
  and nothing is reordered. transformers un-permutes for "llama" only (`LlamaTensorProcessor`).
- RMSNorm weights stored as 1 + w: only for `gemma3` (and the Gemma family). Gemma's RMSNorm
  multiplies by (1 + w); llama.cpp's converter adds the 1 to every `*norm.weight` so that its
  RMSNorm multiplies by the stored value. The HF checkpoint holds w: subtract 1 from every norm,
  q_norm and k_norm included (transformers' `Gemma2TensorProcessor`, used for gemma3, does this).
"""

from __future__ import annotations

from typing import Any

from nanoserve.model.config import CheckpointError, ConfigError

# general.architecture -> (HF class, HF model_type)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
FAMILY_NAMES = "llama (Llama, Mistral, SmolLM2), qwen2 (Qwen2, Qwen2.5), qwen3, gemma3 (Gemma 3 text)"
PERMUTED_QK = ("llama",)  # families whose q_proj / k_proj rows llama.cpp reorders for its RoPE
NORMS_STORED_PLUS_ONE = ("gemma3",)  # families whose RMSNorm weights llama.cpp stores as 1 + w

# llama.cpp's per-layer tensor names beyond (or unlike) Llama's, by family.
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
LAYER_TENSOR_NAMES: dict[str, dict[str, str]] = {
    "qwen3": _QK_NORMS,
    "gemma3": _QK_NORMS | {
        "post_attention_norm": "post_attention_layernorm",  # after attention, before the residual add
        "ffn_norm": "pre_feedforward_layernorm",  # Llama's ffn_norm is post_attention_layernorm
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}

# Tokens that end a turn in each family's chat format: they join the file's end-of-sequence id,
# so that a chat stops where the model closes its turn (llama.cpp treats them as end-of-generation
# too; HF's generation_config.json of the instruct models lists them).
END_OF_TURN_TOKENS = {
    "qwen2": ("<|im_end|>", "<|endoftext|>"),
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "gemma3": ("<end_of_turn>",),
}

GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's gemma3: 5 sliding-window layers, then one global one
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp hard-codes it for gemma3's sliding layers (HF's default too)

GEMMA_CHAT_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.system = ns.system + (message['content'] | trim) + '\\n\\n' -%}
    {%- else -%}
        {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}
        {{- ns.system + (message['content'] | trim) + '<end_of_turn>\\n' -}}
        {%- set ns.system = '' -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""
"""Gemma's turn format, for a gemma3 file that carries no chat template (gemma-3-270m, a base
model, carries none). It is the family's own format, written here because the file has none:
`<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n`; the assistant's role is
called "model", and Gemma has no system role, so a system message is put in front of the next
turn's text. The tokens are in every Gemma 3 vocabulary; `<end_of_turn>` joins the eos ids."""


def check_architecture(arch: Any) -> str:
    if arch not in FAMILIES:
        raise ConfigError(
            f"unsupported architecture {arch!r} (GGUF metadata general.architecture): nanoserve "
            f"converts {FAMILY_NAMES}"
        )
    return arch


def _clean(x: float) -> float:
    """A float32 from the metadata as the decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(f"{float(x):.7g}")


def eos_ids(arch: str, meta: dict[str, Any]) -> int | list[int] | None:
    """The file's end-of-sequence id, plus the family's end-of-turn tokens found in its vocabulary."""
    eos = meta.get("tokenizer.ggml.eos_token_id")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    extra = [tokens.index(t) for t in END_OF_TURN_TOKENS.get(arch, ()) if t in tokens]
    ids = ([] if eos is None else [int(eos)]) + [i for i in extra if i != eos]
    return ids[0] if len(ids) == 1 else (ids or None)


def family_config(arch: str, meta: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The config.json dict of a qwen2, qwen3 or gemma3 file (llama's is `gguf.config_from_gguf`'s)."""

    def need(key: str) -> Any:
        if meta.get(f"{arch}.{key}") is None:
            raise ConfigError(f"the GGUF metadata has no '{arch}.{key}'")
        return meta[f"{arch}.{key}"]

    if "token_embd.weight" not in tensors:
        raise CheckpointError("the GGUF file has no token_embd.weight tensor")
    hidden, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads)
    value_dim = int(meta.get(f"{arch}.attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise ConfigError(f"key_length {head_dim} != value_length {value_dim}: the HF {arch} classes need them equal")
    num_layers = int(need("block_count"))
    hf_class, model_type = FAMILIES[arch]
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": tensors["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _clean(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids(arch, meta),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }
    theta = _clean(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none") or "none"
    if arch == "gemma3":
        return config | _gemma3_fields(meta, config, theta, scaling)
    if scaling != "none":
        raise ConfigError(f"rope scaling '{scaling}' is not supported for {arch} GGUF files")
    # Qwen2 always has q/k/v biases (HF's Qwen2Attention hard-codes them); Qwen3 may (attention_bias).
    has_bias = "blk.0.attn_q.bias" in tensors
    if arch == "qwen2" and not has_bias:
        raise CheckpointError("a qwen2 GGUF file must hold the attention biases (blk.N.attn_q.bias, ...); it has none")
    return config | {
        "hidden_act": "silu",
        "attention_bias": has_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_layers,
    }


def _gemma3_fields(meta: dict[str, Any], config: dict[str, Any], theta: float, scaling: str) -> dict[str, Any]:
    """Gemma 3's own fields, as llama.cpp runs a gemma3 file (`llama-model.cpp`, LLM_ARCH_GEMMA3)."""
    # >>> week19: gemma3-gguf
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    window = meta.get("gemma3.attention.sliding_window")
    if window:  # layer i attends globally when (i + 1) % 6 == 0, to its last `window` tokens otherwise
        layer_types = ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                       for i in range(num_layers)]
    else:  # newer llama.cpp: a gemma3 file without a window attends globally everywhere
        layer_types = ["full_attention"] * num_layers
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":  # Gemma 3 4B-27B: positions divided by the factor, in the global layers only
        full = {"rope_type": "linear", "rope_theta": theta, "factor": _clean(meta["gemma3.rope.scaling.factor"])}
    elif scaling != "none":
        raise ConfigError(f"rope scaling '{scaling}' is not supported for gemma3 GGUF files (only 'linear')")
    # llama.cpp scales scores by 1/sqrt(head_dim), except for the 27B (62 layers): 1/sqrt(hidden / heads).
    # HF's configs say the same with query_pre_attn_scalar (256 for 270M-12B, 168 for 27B).
    scalar = hidden // config["num_attention_heads"] if num_layers == 62 else config["head_dim"]
    softcap = meta.get("gemma3.final_logit_softcapping")
    attn_softcap = meta.get("gemma3.attn_logit_softcapping")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window else None,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA},
        },
        "final_logit_softcapping": _clean(softcap) if softcap else None,
        "attn_logit_softcapping": _clean(attn_softcap) if attn_softcap else None,
    }
    # <<< week19: gemma3-gguf
