"""Issue 36's GPU figures: what serving many LoRA adapters costs against the base model alone.

    python scripts/make_random_checkpoint.py --out /tmp/llama-3.2-1b-random
    python scripts/bench_lora.py --model /tmp/llama-3.2-1b-random --runs 3 [--profile]

It writes `--adapters` random rank-`--rank` adapters on every linear layer (PEFT's format, no peft
needed) next to the model, then measures each engine (the base alone, and the base with LoRA layers) in its own process, the two
alternated `--runs` times (the median printed with the range):

- offline: `--num-requests` requests (random prompts of 128-512 tokens, 128 output tokens, EOS
  ignored) all at once, spread over the adapters in turn, against the same requests on the base
  model with no LoRA layers, and with LoRA layers but no adapter used (the kernels' floor);
- batch-1 decode: one request of 256 output tokens, with an adapter and without;
- with --profile: the share of the CUDA time the shrink and expand kernels take in the offline
  run with adapters (torch.profiler; kernels replayed from graphs are seen by recent CUPTI only).

Issue 36's targets: offline with 8 adapters ≥ 0.8× the base alone; batch-1 with an adapter ≥ 0.85×.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanoserve.bench.common import throughput_workload
from nanoserve.engine.engine import LLM
from nanoserve.model.config import ModelConfig
from nanoserve.sampling.params import SamplingParams

MODULES = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "hidden", "gate_proj": "inter",
           "up_proj": "inter", "down_proj": "hidden"}


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A random LoRA adapter on every linear layer, as PEFT saves one."""
    sizes = dict(q=config.q_size, kv=config.kv_size, hidden=config.hidden_size, inter=config.intermediate_size)
    inputs = dict(o_proj=config.q_size, down_proj=config.intermediate_size)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, out in MODULES.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inputs.get(module, config.hidden_size), generator=g) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(sizes[out], rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(MODULES), bias="none")))
    return folder


def timed(llm: LLM, prompts, params, loras) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def median(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} (range {min(values):,.1f}-{max(values):,.1f})"


def measure(args, modules: dict[str, str]) -> dict[str, float]:
    """One process, one engine (`--engine base` or `lora`): its rows timed once, after a warm-up."""
    config = ModelConfig.from_json(Path(args.model))
    names = list(modules)
    prompts, _ = throughput_workload(args.num_requests, config.vocab_size, (128, 512), (1, 2))
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    spread = [names[i % len(names)] for i in range(len(prompts))]
    if args.engine == "base":
        llm = LLM(args.model, device=args.device)
        rows = {"offline, base (no LoRA layers)": (prompts, params, None),
                "batch 1, base (no LoRA layers)": (prompts[:1], one, None)}
    else:
        llm = LLM(args.model, device=args.device, lora_modules=modules, max_loras=len(names),
                  max_lora_rank=args.rank)
        rows = {"offline, LoRA layers, no adapter": (prompts, params, None),
                f"offline, {len(names)} adapters": (prompts, params, spread),
                "batch 1, one adapter": (prompts[:1], one, names[0])}
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # kernels compiled
    if args.engine == "lora":  # every adapter resident before the clock starts
        llm.generate(prompts[: len(names)], SamplingParams(max_tokens=2), lora=names, use_tqdm=False)
    result = {}
    for name, (p, sp, loras) in rows.items():
        seconds, tokens = timed(llm, p, sp, loras)
        result[name] = tokens / seconds
    if args.profile and args.engine == "lora":
        profile(llm, prompts, params, spread)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--profile", action="store_true", help="in the last LoRA process")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one process may take")
    ap.add_argument("--engine", choices=["base", "lora"], help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    config = ModelConfig.from_json(Path(args.model))
    root = Path(args.model) / "bench_adapters"
    names = [f"a{i}" for i in range(args.adapters)]
    if args.engine:
        modules = {n: str(root / n) for n in names}
        print("RESULT " + json.dumps(measure(args, modules)), flush=True)
        return
    for i, n in enumerate(names):
        write_adapter(root / n, config, args.rank, seed=i)
    results: dict[str, list[float]] = {}
    for run in range(args.runs):  # each engine in its own process, the two alternated run after run
        for engine in ("base", "lora"):
            cmd = [sys.executable, __file__, "--model", args.model, "--adapters", str(args.adapters),
                   "--rank", str(args.rank), "--num-requests", str(args.num_requests),
                   "--output-tokens", str(args.output_tokens), "--engine", engine]
            cmd += ["--device", args.device] if args.device else []
            cmd += ["--profile"] if args.profile and run == args.runs - 1 else []
            try:
                done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                sys.exit(f"run {run + 1}, engine {engine}: no result after {args.timeout:.0f} s (hung)")
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.exit(f"run {run + 1}, engine {engine} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            print("\n".join(line for line in done.stdout.splitlines() if line.startswith("LoRA kernels")))
            for name, value in json.loads(lines[-1][len("RESULT "):]).items():
                results.setdefault(name, []).append(value)
    for name, values in results.items():
        print(f"{name:40s} {median(values)} output tok/s")
    base, adapters = statistics.median(results["offline, base (no LoRA layers)"]), \
        statistics.median(results[f"offline, {len(names)} adapters"])
    b1, b1_adapter = statistics.median(results["batch 1, base (no LoRA layers)"]), \
        statistics.median(results["batch 1, one adapter"])
    print(f"offline with {len(names)} adapters / base: {adapters / base:.3f} (target ≥ 0.8); "
          f"batch 1 with an adapter / base: {b1_adapter / b1:.3f} (target ≥ 0.85)")


def profile(llm: LLM, prompts, params, loras) -> None:
    """The shrink and expand kernels' share of the CUDA time of one offline run with adapters."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed(llm, prompts, params, loras)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    lora = sum(e.self_device_time_total for e in events if "shrink" in e.key or "expand" in e.key)
    print(f"LoRA kernels: {lora / 1e3:,.1f} ms of {total / 1e3:,.1f} ms CUDA time ({lora / max(total, 1):.1%})")


if __name__ == "__main__":
    main()
