"""Week 22 (issue 33): what each quantization scheme does to a real model's next-token
distributions, against the unquantized model, over the same text.

    python scripts/quant_quality.py [--model smollm2] [--tokens 1024] [--text weeks/week01/README.md]

For every position of the text: the top-1 token of each scheme against the reference's (agreement),
and KL(reference || scheme) of the two next-token distributions, averaged. On the CPU in float32
(the reference is the model as `nanoserve` loads it; for a GGUF file, week 13's widened weights).
fp8 needs a GPU with FP8 tensor cores and is skipped elsewhere.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.engine.tokenizer import Tokenizer
from nanoserve.model.gguf_quantized import use_gguf_blocks
from nanoserve.model.loader import gguf_source, load_model, resolve_model_dir
from nanoserve.model.quantized import quantize_model


@torch.no_grad()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids), device=ids.device), PrefillContext([len(ids)]))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--text", default="weeks/week01/README.md")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tokenizer = Tokenizer(resolve_model_dir(args.model))
    ids = tokenizer.encode(Path(args.text).read_text())[: args.tokens]
    ids = torch.tensor(ids, device=args.device)
    base = load_model(args.model, dtype=dtype, device=args.device)
    reference = log_probs(base, ids)
    schemes = [("int8, default G", "int8", None), ("int8, G = 32", "int8", 32), ("int4, default G", "int4", None),
               ("int4, G = 32", "int4", 32)]
    if gguf_source(args.model) is not None:
        schemes.append(("gguf (the file's blocks)", "gguf", None))
    if args.device.startswith("cuda") and torch.cuda.get_device_capability() >= (8, 9):
        schemes.append(("fp8", "fp8", None))
    print(f"{args.model}, {len(ids)} tokens of {args.text}, {dtype}, reference: the model as loaded")
    print(f"{'scheme':>26} {'top-1 agreement':>16} {'mean KL (nats)':>15} {'seconds':>8}")
    for name, scheme, group in schemes:
        start = time.perf_counter()
        model = copy.deepcopy(base)
        if scheme == "gguf":
            use_gguf_blocks(model, gguf_source(args.model))
        else:
            quantize_model(model, scheme, group)
        ours = log_probs(model, ids)
        agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
        kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
        print(f"{name:>26} {agree:16.4f} {kl:15.5f} {time.perf_counter() - start:8.1f}")


if __name__ == "__main__":
    main()
