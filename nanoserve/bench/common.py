"""Week 12: `nanoserve bench`, three measurements with HuggingFace side by side.

    nanoserve bench latency    --model DIR    batch-1 decode tok/s, next to the bandwidth roofline
    nanoserve bench throughput --model DIR    offline: N requests at once, output tok/s
    nanoserve bench serving    --model DIR    Poisson arrivals over HTTP: TTFT and ITL p50/p99
    nanoserve bench all        --model DIR    the three, one after the other

Every run prints a table and writes `<out>/<name>.json` (the numbers, the machine, the
software, the date and the command) and `<out>/<name>.png`. `--quick` shrinks every workload
so that the whole thing runs in a minute on a CPU with the bundled tiny model (CI runs it).

The workloads (random token ids; EOS ignored, so every request produces exactly its length):
- latency: one prompt of --prompt-len tokens, --new-tokens greedy tokens, --runs times (5); the
  median of runs 2 onwards (the first compiles kernels), with their min and max. Decode speed leaves the prefill out:
  (tokens - 1) / (time from the first token to the last). The roofline is the speed
  of a step that does nothing but read every weight once at the measured copy bandwidth.
- throughput: --num-requests requests, prompt and output lengths uniform in --prompt-len and
  --output-len ([100, 1024] each by default), all submitted at once.
- serving: `nanoserve serve` in its own process (in the workspace NANOSERVE_WORKSPACE names, if
  set, so that it imports the learner's package); streaming requests with exponential gaps.
  `--check capstone-cpu` fixes the workload and checks the capstone's targets (nanoserve/bench/capstone.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

# ------------------------------------------------------------------------------------ helpers


def kv_pool(engine) -> dict:
    """The engine's KV pool (on the driver's rank): its format (issue 33's `--kv-cache-dtype`), its blocks
    (with the CUDA graphs' scratch block), their tokens and bytes each; printed in one line too."""
    cache = engine.runner.cache
    pool = dict(kv_cache_dtype=cache.kv_cache_dtype, kv_blocks=cache.num_blocks, kv_block_tokens=cache.block_size,
                kv_block_bytes=cache.nbytes // cache.num_blocks)
    print(f"KV pool: {pool['kv_blocks']:,} blocks of {pool['kv_block_tokens']} tokens "
          f"({pool['kv_blocks'] * pool['kv_block_tokens']:,} tokens), --kv-cache-dtype {pool['kv_cache_dtype']}, "
          f"{pool['kv_block_bytes']:,} bytes a block")
    return pool


def copy_bandwidth(device: str, nbytes: int = 2**30) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return 2 * nbytes / (do_bench(lambda: dst.copy_(src), warmup=50, rep=300) * 1e-3)
    src = torch.empty(nbytes // 8, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, start = 10, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * src.numel() * reps / (time.perf_counter() - start)


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def vocab_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def free_gpu() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def throughput_workload(n: int, vocab: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                        seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return prompts, [rng.randint(*output_len) for _ in range(n)]


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) if r.get(k) is not None else "-"
                                             for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for j, line in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            print("  " + "  ".join("-" * w for w in widths))


def save_result(out_dir: str | Path, name: str, **fields) -> Path:
    """Write `fields` plus the GPU, the software, the date and the command to out_dir/name.json."""
    import platform

    meta = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor()})",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                command="nanoserve " + " ".join(sys.argv[1:]) if sys.argv and "nanoserve" in sys.argv[0] else None,
                **fields)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(meta, indent=2))
    print(f"wrote {path}")
    return path


def save_plot(path: Path, draw) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def hf_model(model_dir: Path, dtype: torch.dtype, device: str):
    """HF's model for the checkpoint, whatever its family (the class its config names)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


# --------------------------------------------------------------------------------- throughput






# ------------------------------------------------------------------------------ command line


def save_and_plot(args, name: str, result: dict, draw) -> None:
    save_result(args.out, name, **result)
    save_plot(Path(args.out) / f"{name}.png", draw)


def int_pair(text: str) -> tuple[int, int]:
    lo, hi = map(int, text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 'LOW,HIGH' with 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


