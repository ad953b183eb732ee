"""What structured output costs an engine step on the GPU (issue 17): the median decode step of
a batch with no constraint, and of the same batch with every row constrained.

    python scripts/make_random_checkpoint.py --out /tmp/ckpt
    cp TOKENIZER_DIR/tokenizer*.json /tmp/ckpt/   # a real byte-level BPE tokenizer (the model's vocab may be larger)
    python scripts/bench_grammar_step.py --model /tmp/ckpt [--batch 1 8 32 64] [--tokens 64]

Each row writes the inside of one long JSON string (minLength 1000: the grammar never completes
within --tokens); the constrained step pays for the batch's masks (llguidance fills the packed rows
on its own threads while the GPU still runs the forward pass the engine launched) and for
unpacking and applying them on the GPU. Also printed: the host time of `token_bitmasks` alone.
With --runs R, each figure is the median over R repetitions, with min and max.
"""

from __future__ import annotations

import argparse
import statistics
import time

import nanoserve.sampling.grammar

from nanoserve.engine.engine import Engine
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.grammar import grammar_for

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000, "maxLength": 1000}},
          "required": ["text"], "additionalProperties": False}


def median_decode_step(engine: Engine, batch: int, tokens: int, grammar: str | None) -> float:
    for _ in range(2):  # the first run warms up (graphs, allocator)
        engine.trace.clear()
        for i in range(batch):
            engine.add_request([1000 + i] * 16, SamplingParams(temperature=1.0, seed=i, max_tokens=tokens,
                                                               ignore_eos=True, grammar=grammar))
        while engine.has_unfinished():
            engine.step()
    steps = [r.end - r.start for r in engine.trace if len(r.seq_ids) == batch and set(r.num_new_tokens) == {1}]
    return statistics.median(steps)


MASK_TIMES: list[float] = []


def timed_bitmasks(constraints, vocab_size):
    start = time.perf_counter()
    packed = TOKEN_BITMASKS(constraints, vocab_size)
    MASK_TIMES.append(time.perf_counter() - start)
    return packed


TOKEN_BITMASKS = nanoserve.sampling.grammar.token_bitmasks
nanoserve.sampling.grammar.token_bitmasks = timed_bitmasks


def spread(values: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(values) * scale:.2f} ({min(values) * scale:.2f}-{max(values) * scale:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, trace=True, enable_prefix_caching=False))
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "long", "schema": SCHEMA}})
    print(f"vocab: model {engine.model.config.vocab_size}, tokenizer {engine.tokenizer.vocab_size}")
    print("batch | plain step ms | constrained step ms | added ms | per row us | token_bitmasks alone ms")
    for batch in args.batch:
        plain, constrained, masks = [], [], []
        for _ in range(args.runs):
            plain.append(median_decode_step(engine, batch, args.tokens, None))
            MASK_TIMES.clear()
            constrained.append(median_decode_step(engine, batch, args.tokens, grammar))
            masks.append(statistics.median(MASK_TIMES))
        added = [c - p for c, p in zip(constrained, plain)]
        print(f"{batch:5d} | {spread(plain)} | {spread(constrained)} | {spread(added)} | "
              f"{statistics.median(added) / batch * 1e6:.0f} | {spread(masks)}")


if __name__ == "__main__":
    main()
