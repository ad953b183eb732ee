"""Week 22 (issue 33): what each quantization scheme does to a real model's next-token
distributions, against the unquantized model, over the same text.

    python scripts/quant_quality.py [--model smollm2] [--tokens 1024] [--text weeks/week01/README.md] [--kv-only]

For every position of the text: the top-1 token of each scheme against the reference's (agreement),
and KL(reference || scheme) of the two next-token distributions, averaged. On the CPU in float32
(the reference is the model as `nanoserve` loads it; for a GGUF file, week 13's widened weights).
fp8 runs as the prompt runs, W8A8 (`Fp8Linear.scaled_product`: the activations cut to e4m3 per
row too), on the CPU through PyTorch's own `_scaled_mm`, whose output is bfloat16: so its row
carries bf16 rounding of every projection's output besides the FP8 error. (At decode, up to four
rows, a GPU runs the weight-only `fp8_gemv` instead: the activations stay as they are.)

The last rows keep the weights as loaded and store the KV cache instead (`--kv-cache-dtype`): the text
runs as one prompt over a paged pool, so every position attends over K/V read back from the pool,
as a decode step would over its past. "auto" is the same arithmetic as the reference; "fp8" is
issue 33's e4m3 codes with a float16 scale per token and head (its PyTorch reference path, which
runs on the CPU too).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from nanoserve.attention.base import PrefillContext
from nanoserve.attention.fp8_cache import kv_cache_class
from nanoserve.attention.paged import PagedAttentionMetadata, PagedContext
from nanoserve.engine.tokenizer import Tokenizer
from nanoserve.model.gguf_quantized import use_gguf_blocks
from nanoserve.model.loader import gguf_source, load_model, resolve_model_dir
from nanoserve.model.quantized import quantize_model
from nanoserve.scheduler.blocks import blocks_needed


@torch.no_grad()
def log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids), device=ids.device), PrefillContext([len(ids)]))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


@torch.no_grad()
def log_probs_over_a_pool(model, ids: torch.Tensor, kv_cache_dtype: str, block_size: int = 16) -> torch.Tensor:
    """`log_probs`, with K/V written into a paged pool of `kv_cache_dtype` and read back from it."""
    cfg, n = model.config, len(ids)
    num_blocks = blocks_needed(n, block_size)
    cache = kv_cache_class(kv_cache_dtype)(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                           dtype=model.embed_tokens.weight.dtype, device=ids.device)
    meta = PagedAttentionMetadata.build(list(range(n)), [0, n], [n], [list(range(num_blocks))], device=ids.device)
    hidden = model(ids, torch.arange(n, device=ids.device), PagedContext(cache, meta))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def report(name: str, ours: torch.Tensor, reference: torch.Tensor, start: float) -> None:
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
    print(f"{name:>26} {agree:16.4f} {kl:15.5f} {time.perf_counter() - start:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--text", default="weeks/week01/README.md")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-only", action="store_true", help="only the KV cache rows (the weights as loaded)")
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
    if not args.device.startswith("cuda") or torch.cuda.get_device_capability() >= (8, 9):
        schemes.append(("fp8 (W8A8, bf16 output)", "fp8", None))
    if args.kv_only:
        schemes = []
    print(f"{args.model}, {len(ids)} tokens of {args.text}, {dtype}, reference: the model as loaded")
    print(f"{'scheme':>26} {'top-1 agreement':>16} {'mean KL (nats)':>15} {'seconds':>8}")
    for name, scheme, group in schemes:
        start = time.perf_counter()
        model = copy.deepcopy(base)
        if scheme == "gguf":
            use_gguf_blocks(model, gguf_source(args.model))
        else:
            quantize_model(model, scheme, group)
        report(name, log_probs(model, ids), reference, start)
    for kv_cache_dtype in ("auto", "fp8"):
        start = time.perf_counter()
        report(f"KV cache {kv_cache_dtype}", log_probs_over_a_pool(base, ids, kv_cache_dtype), reference, start)


if __name__ == "__main__":
    main()
