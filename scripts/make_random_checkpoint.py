"""Write a random-weight checkpoint of the exact Llama-3.2-1B shape (for benchmarks, no download).

    python scripts/make_random_checkpoint.py --out /tmp/llama-3.2-1b-random [--dtype bfloat16] [--device cuda]

The weights are HuggingFace's own random initialisation (std 0.02) saved with `save_pretrained`,
next to the tiny model's tokenizer files: token ids above its 4096-entry vocabulary decode to
nothing, which is fine for measuring speed. Speed does not depend on what the weights are.
"""

from __future__ import annotations

import argparse

import torch

from nanoserve.testing import LLAMA_3_2_1B, save_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_2_1B)).to(getattr(torch, args.dtype))
    save_checkpoint(model, args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters in {args.dtype}")


if __name__ == "__main__":
    main()
