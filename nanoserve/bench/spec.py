"""Week 17's benchmark: what speculative decoding buys at batch 1.

    nanoserve bench spec --model smollm2 [--speculative ngram|draft] [--num-speculative-tokens 4]
    nanoserve bench spec --model DIR --forced-acceptance 0,0.5,0.9,1   # the ceiling, on any model
    nanoserve bench spec --model DIR --batch-sweep 1,2,4,8,16        # where guessing stops paying

Default: a chat model answers two kinds of prompts, each alone (batch 1), greedy, with
speculation off and on (two engines, runs alternated):
- copy-heavy: edit this code, summarise with quotes, extract fields from a text: the answer
  repeats the prompt, which prompt lookup can find;
- open-ended chat: little to copy.
For each: the acceptance rate, tokens per target step, decode speed off and on, and whether the
text is identical (it must be: greedy verification changes nothing).

`--forced-acceptance P1,P2,...`: a timing experiment. Random guesses, each accepted with
probability P whatever the target says, so each target step emits on average
(1 - P^(k+1)) / (1 - P) tokens. P = 1 is the ceiling: k + 1 tokens per step, and the speed-up is
(k + 1) x decode step time / verify step time. The sweep shows the speed-up against the acceptance
rate, and what verifying k + 1 tokens costs next to decoding one.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace

from nanoserve.bench.common import free_gpu, print_table, save_and_plot, sync_device

CODE = '''def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        raise ValueError("mean of an empty list")
    return total / count


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''

TEXT = ("The Hubble Space Telescope was launched into low Earth orbit in 1990 and remains in operation. "
        "It was not the first space telescope, but it is one of the largest and most versatile, renowned "
        "both as a vital research tool and as a public relations boon for astronomy. The telescope is named "
        "after the astronomer Edwin Hubble. Its four main instruments observe in the ultraviolet, visible, "
        "and near-infrared regions of the electromagnetic spectrum. Hubble's orbit outside the distortion of "
        "Earth's atmosphere allows it to capture extremely high-resolution images with substantially lower "
        "background light than ground-based telescopes.")

INVOICE = ("Invoice number: INV-2026-0417\nDate: 14 March 2026\nBill to: Margaret Okafor, 12 Harbour Road, Leith\n"
           "Items: 3 x oak chairs at 120.00 each; 1 x oak table at 640.00\nSubtotal: 1000.00\nVAT (20%): 200.00\n"
           "Total due: 1200.00\nPayment terms: 30 days\n")

WORKLOADS = {
    "copy": [
        f"Copy this code and add a comment above each function:\n\n```python\n{CODE}```",
        f"Here is some Python code:\n\n```python\n{CODE}```\n\nRewrite the code above with the variable `total` "
        "renamed to `running_sum`.",
        f"Summarise this text in three sentences, quoting its key phrases exactly:\n\n{TEXT}",
        f"Convert this invoice to JSON:\n\n{INVOICE}",
    ],
    "chat": [
        "Tell me a short story about a dragon who learns to bake bread.",
        "What are three benefits of regular exercise?",
        "Write a short poem about the sea at night.",
        "Give me some tips for learning a new language.",
    ],
}


class RandomProposer:
    """k random guesses per step (for the forced-acceptance sweep, where their content is moot)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose_batch(self, token_lists: list[list[int]], ks: list[int]) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in ks]


def forced_verify(accept: float, seed: int = 0):
    """A verifier for timing only: each guess is accepted with probability `accept`, whatever
    the target says (the text is then not the target's). Its cost is the greedy verifier's: one
    argmax and a copy."""
    rng = random.Random(seed)

    def verify(logits, drafts, seqs, probs):
        target = logits.argmax(dim=-1).tolist()
        out, row = [], 0
        for d in drafts:
            n = 0
            while n < len(d) and rng.random() < accept:
                n += 1
            out.append(d[:n] + [target[row + n]])
            row += len(d) + 1
        return out

    return verify


def decode_run(engine, prompt: list[int], max_tokens: int) -> dict:
    """One request alone, greedy: its tokens and decode speed ((tokens - 1) / first to last token)."""
    from nanoserve.sampling.params import SamplingParams

    device = str(engine.runner.device)
    spec = engine.speculator
    before = None if spec is None else replace(spec.stats)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), stream=False)
    times, steps, out = [], 0, None
    while engine.has_unfinished():
        outs = engine.step()
        sync_device(device)
        times.append(time.perf_counter())
        steps += 1
        out = next((o for o in outs if o.request_id == rid), out)
    n = len(out.token_ids)
    row = dict(tokens=out.token_ids, n=n, steps=steps,
               tok_s=(n - 1) / (times[-1] - times[0]) if n > 1 and len(times) > 1 else float("nan"),
               step_ms=1e3 * (times[-1] - times[0]) / max(1, steps - 1))
    if spec is not None:
        proposed = spec.stats.num_proposed - before.num_proposed
        row["acceptance"] = (spec.stats.num_accepted - before.num_accepted) / proposed if proposed else 0.0
        row["tokens_per_step"] = (n - 1) / max(1, steps - 1)
    return row


def bench_spec(args) -> dict:
    from nanoserve.engine.config import EngineConfig, default_device
    from nanoserve.engine.engine import Engine
    from nanoserve.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    base = replace(EngineConfig.from_args(args), model=model_dir, enable_prefix_caching=False)
    if base.kv_cache_memory is None and (base.device or default_device()).startswith("cuda"):
        # two engines in one GPU: each gets a fixed pool (ample at batch 1) instead of 90% of the memory
        base = replace(base, kv_cache_memory=4 * 2**30)
    method = args.speculative or "ngram"
    off = Engine(replace(base, speculative=None))
    on = Engine(replace(base, speculative=method, speculative_max_batch=max(1, args.speculative_max_batch)))
    if args.forced_acceptance:
        result = _forced_sweep(args, off, on)
    elif args.batch_sweep:
        result = _batch_sweep(args, off, on, method)
    else:
        result = _workloads(args, off, on, method)
    del off, on
    free_gpu()
    return result


def _prompt_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    try:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    except ValueError:  # no chat template: the text as it is
        return tok.encode(text)


def _workloads(args, off, on, method: str) -> dict:
    rows = []
    for workload, texts in WORKLOADS.items():
        for text in texts[: args.spec_prompts]:
            prompt = _prompt_ids(off, text)
            runs_off, runs_on = [], []
            for _ in range(args.spec_runs):  # alternated, so drift hits both sides alike
                runs_off.append(decode_run(off, prompt, args.new_tokens))
                runs_on.append(decode_run(on, prompt, args.new_tokens))
            same = all(r["tokens"] == runs_off[0]["tokens"] for r in runs_off + runs_on)
            tok_off = statistics.median(r["tok_s"] for r in runs_off[1:] or runs_off)  # run 1 warms up
            tok_on = statistics.median(r["tok_s"] for r in runs_on[1:] or runs_on)
            last = runs_on[-1]
            rows.append(dict(workload=workload, prompt=text[:32].replace("\n", " "), tokens=last["n"],
                             acceptance=last["acceptance"], tokens_per_step=last["tokens_per_step"],
                             off_tok_s=tok_off, on_tok_s=tok_on, speedup=tok_on / tok_off, identical=same,
                             off_runs=[r["tok_s"] for r in runs_off], on_runs=[r["tok_s"] for r in runs_on]))
    print_table(f"speculative decoding at batch 1 ({method}, k={args.num_speculative_tokens}, greedy, "
                f"up to {args.new_tokens} tokens; median of runs 2..{args.spec_runs})", rows,
                [("workload", "workload", ""), ("prompt", "prompt", ""), ("tokens", "tokens", "d"),
                 ("acceptance", "accepted", ".2f"), ("tokens_per_step", "tok/step", ".2f"),
                 ("off_tok_s", "off tok/s", ".1f"), ("on_tok_s", "on tok/s", ".1f"), ("speedup", "speed-up", ".2f"),
                 ("identical", "same text", "")])
    summary = {w: statistics.median(r["speedup"] for r in rows if r["workload"] == w) for w in WORKLOADS}
    print("median speed-up: " + ", ".join(f"{w} {s:.2f}x" for w, s in summary.items()))
    result = dict(model=str(args.model), method=method, k=args.num_speculative_tokens, rows=rows,
                  median_speedup=summary, all_identical=all(r["identical"] for r in rows))

    def draw(ax):
        for w, marker in zip(WORKLOADS, "os"):
            pts = [r for r in rows if r["workload"] == w]
            ax.scatter([r["acceptance"] for r in pts], [r["speedup"] for r in pts], marker=marker, label=w)
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("acceptance rate")
        ax.set_ylabel("batch-1 speed-up")
        ax.legend()

    save_and_plot(args, "spec", result, draw)
    return result


def _forced_sweep(args, off, on) -> dict:
    from nanoserve.sampling.rejection import expected_tokens_per_step

    vocab = off.model.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    base_runs = [decode_run(off, prompt, args.new_tokens) for _ in range(args.spec_runs)]
    tok_off = statistics.median(r["tok_s"] for r in base_runs[1:] or base_runs)
    decode_ms = statistics.median(r["step_ms"] for r in base_runs[1:] or base_runs)
    on.speculator.proposer = RandomProposer(vocab)
    k, rows = args.num_speculative_tokens, []
    for accept in map(float, args.forced_acceptance.split(",")):
        on.speculator.accept = forced_verify(accept)
        runs = [decode_run(on, prompt, args.new_tokens) for _ in range(args.spec_runs)]
        used = runs[1:] or runs
        tok_on = statistics.median(r["tok_s"] for r in used)
        rows.append(dict(accept=accept, expected_tokens_per_step=expected_tokens_per_step(accept, k),
                         tokens_per_step=statistics.median(r["tokens_per_step"] for r in used),
                         step_ms=statistics.median(r["step_ms"] for r in used), tok_s=tok_on,
                         speedup=tok_on / tok_off, runs=[r["tok_s"] for r in runs]))
    print(f"\nwithout speculation: {tok_off:.1f} tok/s, {decode_ms:.3f} ms per decode step")
    print_table(f"forced acceptance, k={k}, batch 1, {args.new_tokens} tokens (each guess accepted with "
                "probability P, whatever the target says: a timing experiment)", rows,
                [("accept", "P", ".2f"), ("expected_tokens_per_step", "(1-P^(k+1))/(1-P)", ".2f"),
                 ("tokens_per_step", "tok/step", ".2f"), ("step_ms", "ms/step", ".3f"), ("tok_s", "tok/s", ".1f"),
                 ("speedup", "speed-up", ".2f")])
    result = dict(model=str(args.model), k=k, off_tok_s=tok_off, decode_step_ms=decode_ms,
                  off_runs=[r["tok_s"] for r in base_runs], rows=rows)

    def draw(ax):
        ax.plot([r["accept"] for r in rows], [r["speedup"] for r in rows], "o-", label="measured")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("acceptance probability per guess")
        ax.set_ylabel("batch-1 speed-up")
        ax.legend()

    save_and_plot(args, "spec_forced", result, draw)
    return result


def _batch_sweep(args, off, on, method: str) -> dict:
    """Output tokens/s of B requests decoding together (the copy-heavy prompts, cycled), with
    speculation off and on, for each B: where does guessing stop paying?"""
    from nanoserve.sampling.params import SamplingParams

    on.speculator.max_batch = 10**9  # this sweep decides the limit: no limit while measuring it
    prompts = [_prompt_ids(off, t) for t in WORKLOADS["copy"]]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in map(int, args.batch_sweep.split(",")):
        speeds = {"off": [], "on": []}
        for _ in range(args.spec_runs):
            for name, engine in (("off", off), ("on", on)):
                for i in range(batch):
                    engine.add_request(prompts[i % len(prompts)], params, stream=False)
                engine.step()  # the prefills, not timed
                sync_device(str(engine.runner.device))
                start, tokens = time.perf_counter(), 0
                while engine.has_unfinished():
                    tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
                sync_device(str(engine.runner.device))
                speeds[name].append((tokens - batch) / (time.perf_counter() - start))
        off_s, on_s = (statistics.median(speeds[k][1:] or speeds[k]) for k in ("off", "on"))
        rows.append(dict(batch=batch, off_tok_s=off_s, on_tok_s=on_s, ratio=on_s / off_s,
                         off_runs=speeds["off"], on_runs=speeds["on"]))
    print_table(f"decodes together, {method} k={args.num_speculative_tokens}, copy-heavy prompts, "
                f"{args.new_tokens} tokens each", rows,
                [("batch", "batch", "d"), ("off_tok_s", "off tok/s", ",.0f"), ("on_tok_s", "on tok/s", ",.0f"),
                 ("ratio", "on / off", ".2f")])
    result = dict(model=str(args.model), method=method, k=args.num_speculative_tokens, rows=rows)

    def draw(ax):
        ax.plot([r["batch"] for r in rows], [r["ratio"] for r in rows], "o-")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decodes per step")
        ax.set_ylabel("speculation on / off, output tok/s")

    save_and_plot(args, "spec_batch", result, draw)
    return result


def add_arguments(p) -> None:
    p.add_argument("--forced-acceptance", default=None, help="spec: instead of the prompt workloads, accept each "
                   "guess with these probabilities (e.g. 0,0.5,0.9,1), whatever the target says: the speed-up "
                   "against the acceptance rate, and its ceiling")
    p.add_argument("--batch-sweep", default=None, help="spec: output tok/s with speculation off and on for these "
                   "numbers of requests decoding together (e.g. 1,2,4,8,16,32)")
    p.add_argument("--spec-runs", type=int, default=3, help="spec: runs per prompt and setting (the first warms up)")
    p.add_argument("--spec-prompts", type=int, default=4, help="spec: prompts per workload")


QUICK = dict(spec_runs=2, spec_prompts=1)
