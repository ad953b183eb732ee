"""Write a random-weight checkpoint of the exact Llama-3.2-1B shape (or, with --shape 8b, of
Llama-3.1-8B's: week 18), for benchmarks, with no download.

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


def write_word_tokenizer(out: str, vocab_size: int) -> None:
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(out) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w128000", "eos_token": "w128001",
              "model_max_length": 131072}
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="1b", choices=["1b", "8b"], help="Llama-3.2-1B (default) or Llama-3.1-8B")
    args = ap.parse_args()
    shape = LLAMA_3_2_1B if args.shape == "1b" else LLAMA_3_1_8B
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(getattr(torch, args.dtype))
    save_checkpoint(model, args.out, with_tokenizer=False)
    write_word_tokenizer(args.out, shape["vocab_size"])
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters in {args.dtype}")


if __name__ == "__main__":
    main()
