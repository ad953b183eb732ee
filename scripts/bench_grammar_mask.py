"""What a grammar mask costs on the CPU, per constrained row and step (issue 17, week 10's lesson).

    python scripts/bench_grammar_mask.py [--tokenizer DIR_OR_HUB_ID ...]  (default: the tiny model's)

For each tokenizer: 20 response formats (every fifth `json_object`, the others random schemas
from tests/week10/test_structured_output.py), each walked by drawing a random allowed token per
step until the grammar is complete (60 steps at most); times `TokenConstraint.allowed` (the
mask and its unpacking into bools) at every step. No model runs: this is the host's share only.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "week10"))

from test_structured_output import random_object_schema, schema_format  # noqa: E402

from nanoserve.sampling.grammar import TokenConstraint, grammar_for, make_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", nargs="+", default=["tiny"])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from nanoserve.model.loader import resolve_model_dir

    for name in args.tokenizer:
        hf = AutoTokenizer.from_pretrained(resolve_model_dir(name) if name == "tiny" else name)
        start = time.perf_counter()
        tokenizer = make_tokenizer(hf)
        build = time.perf_counter() - start
        rng, times = random.Random(0), []
        for i in range(20):
            fmt = {"type": "json_object"} if i % 5 == 0 else schema_format(random_object_schema(rng), "x")
            c = TokenConstraint(tokenizer, grammar_for(fmt), tokenizer.vocab_size, frozenset([tokenizer.eos_token]))
            for _ in range(60):
                start = time.perf_counter()
                mask = c.allowed()
                times.append(time.perf_counter() - start)
                if c.consume(rng.choice(mask.nonzero().flatten().tolist())):
                    break
        us = np.array(times) * 1e6
        print(f"{name}: vocab {tokenizer.vocab_size}, tokenizer view built in {build * 1e3:.0f} ms; mask per step: "
              f"median {np.median(us):.0f} us, p90 {np.percentile(us, 90):.0f} us, max {us.max():.0f} us "
              f"({len(us)} steps)")


if __name__ == "__main__":
    main()
