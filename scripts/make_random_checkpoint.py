"""Write a random-weight checkpoint of the exact Llama-3.2-1B shape (or, with --shape 8b, of
Llama-3.1-8B's: week 18; with gemma3-270m or qwen3-0.6b, of those models': week 19; with
mixtral-8x7b or qwen1.5-moe-a2.7b, of those mixtures of experts', fewer layers with --num-layers:
week 24), for benchmarks, with no download.

    python scripts/make_random_checkpoint.py --out /tmp/llama-3.2-1b-random [--dtype bfloat16] [--device cuda]

The weights are HuggingFace's own random initialisation (std 0.02) saved with `save_pretrained`.
The tokenizer is a synthetic word-level one covering the whole 128,256-token vocabulary (token i
is the word "w<i>"), so that every generated token decodes to some text and streams as its own
chunk, as a real tokenizer's would. Speed does not depend on what the weights or words are.
"""

from __future__ import annotations

import argparse

import torch

from nanoserve.testing import LLAMA_3_1_8B, LLAMA_3_2_1B, save_checkpoint


GEMMA3_270M = dict(  # google/gemma-3-270m's config.json (the GGUF file's metadata agrees)
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=512,
    query_pre_attn_scalar=256, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                     "full_attention": dict(rope_type="default", rope_theta=1000000.0)},
)
QWEN3_0_6B = dict(  # Qwen/Qwen3-0.6B's config.json
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
    bos_token_id=151643, eos_token_id=151645, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
)
MIXTRAL_8X7B = dict(  # mistralai/Mixtral-8x7B-v0.1's config.json (week 24)
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_parameters=dict(rope_type="default", rope_theta=1e6),
)
QWEN1_5_MOE_A2_7B = dict(  # Qwen/Qwen1.5-MoE-A2.7B's config.json (week 24)
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, rms_norm_eps=1e-6, max_position_embeddings=8192, num_experts=60, num_experts_per_tok=4,
    moe_intermediate_size=1408, shared_expert_intermediate_size=5632, norm_topk_prob=False, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151643, rope_parameters=dict(rope_type="default", rope_theta=1e6),
)
SHAPES = {
    "1b": ("LlamaForCausalLM", "LlamaConfig", LLAMA_3_2_1B),
    "8b": ("LlamaForCausalLM", "LlamaConfig", LLAMA_3_1_8B),
    "gemma3-270m": ("Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3_270M),
    "qwen3-0.6b": ("Qwen3ForCausalLM", "Qwen3Config", QWEN3_0_6B),
    "mixtral-8x7b": ("MixtralForCausalLM", "MixtralConfig", MIXTRAL_8X7B),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", QWEN1_5_MOE_A2_7B),
}


def write_word_tokenizer(out: str, vocab_size: int, bos: int = 128000, eos: int = 128001) -> None:
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(out) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"w{bos}", "eos_token": f"w{eos}",
              "model_max_length": 131072}
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="1b", choices=list(SHAPES),
                    help="Llama-3.2-1B (default), Llama-3.1-8B, Gemma 3 270M, Qwen3-0.6B, or the mixtures of experts "
                         "Mixtral 8x7B and Qwen1.5-MoE-A2.7B")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="keep only this many layers of the shape (Mixtral 8x7B's 32 need 93 GB in bf16)")
    args = ap.parse_args()
    architecture, config_class, shape = SHAPES[args.shape]
    if args.num_layers is not None:
        shape = dict(shape, num_hidden_layers=args.num_layers)
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**shape)
    config.architectures = [architecture]
    with torch.device(args.device):
        model = getattr(transformers, architecture)(config).to(getattr(torch, args.dtype))
    save_checkpoint(model, args.out, with_tokenizer=False)
    write_word_tokenizer(args.out, shape["vocab_size"], shape["bos_token_id"], shape["eos_token_id"])
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters in {args.dtype}")


if __name__ == "__main__":
    main()
