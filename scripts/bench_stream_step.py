"""Host time of a streaming decode step: the tokenizer's decode through HF's wrapper or direct.

    python scripts/bench_stream_step.py --model /tmp/llama1b --batch 255

`Engine.step()`, as the server calls it, detokenizes every running sequence's new token (two
`Tokenizer.decode` calls a token) and builds an output for it. This fills the engine with --batch
greedy requests of --prompt-len random tokens (EOS ignored), lets them decode for a while, then
times --rounds rounds of --steps steps, alternating `Tokenizer.decode`'s two paths (the Rust
tokenizer called directly, and HF's wrapper around it) in one process, with the engine's defaults
otherwise. Then `nanoserve.bench.latency.step_breakdown` splits the plain loop's step into its phases, for
each path twice. The step grows as the sequences do, so compare the rounds in pairs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nanoserve.bench.latency import step_breakdown
from nanoserve.engine.engine import Engine
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams


def sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=255)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    engine = Engine(EngineConfig(model=args.model))
    direct = engine.tokenizer._rust_decode
    if direct is None:
        raise SystemExit("this tokenizer is decoded through HF's wrapper only: nothing to compare")
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    for _ in range(40):
        engine.step()
    times = {"wrapper": [], "direct": []}
    for r in range(args.rounds):
        for path in ("wrapper", "direct") if r % 2 == 0 else ("direct", "wrapper"):
            engine.tokenizer._rust_decode = direct if path == "direct" else None
            sync(engine)
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            sync(engine)
            times[path].append(1e3 * (time.perf_counter() - start) / args.steps)
    for path, ms in times.items():
        print(f"{path:>7}: ms a step at batch {args.batch}: median {statistics.median(ms):.2f} "
              f"(min {min(ms):.2f}, max {max(ms):.2f}); rounds {', '.join(f'{x:.2f}' for x in ms)}")
    faster = sum(d < w for d, w in zip(times["direct"], times["wrapper"]))
    print(f"direct faster in {faster} of {args.rounds} rounds")
    for path in ("wrapper", "direct", "wrapper", "direct"):
        engine.tokenizer._rust_decode = direct if path == "direct" else None
        phases = step_breakdown(engine, args.steps)
        print(f"{path:>7}: plain loop, ms a step: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    engine.tokenizer._rust_decode = direct


if __name__ == "__main__":
    main()
