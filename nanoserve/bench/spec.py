"""Week 17's benchmark: what speculative decoding buys at batch 1.

    nanoserve bench spec --model smollm2 [--speculative ngram|draft] [--num-speculative-tokens 4]
    nanoserve bench spec --model DIR --forced-acceptance 0,0.5,0.9,1   # the ceiling, on any model
    nanoserve bench spec --model DIR --batch-sweep 1,2,4,8,16        # where guessing stops paying

Default: a chat model answers two kinds of prompts, each alone (batch 1), greedy, with
speculation off and on:
- copy-heavy: edit this code, summarise with quotes, extract fields from a text: the answer
  repeats the prompt, which prompt lookup can find;
- open-ended chat: little to copy.
For each: the acceptance rate, tokens per target step, decode speed off and on, and whether the
text is identical (it must be: greedy verification changes nothing).

In every experiment, each run of a side (speculation off, on) is an engine in a fresh process,
off and on alternated, --repeats times each (3; nanoserve/bench/alternate.py says why); in each
process every measurement runs --spec-runs times, the first warming up, and that process's figure
is the median of the others. The tables give the median over the processes with their range; the
speed-ups are the ratios of the medians.

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

from nanoserve.bench.alternate import Summary, as_json, describe, repeats_of, run_alternated, summarize, with_spread
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
    from nanoserve.engine.config import EngineConfig
    from nanoserve.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    base = replace(EngineConfig.from_args(args), model=model_dir, enable_prefix_caching=False)
    method = args.speculative or "ngram"
    on = replace(base, speculative=method, speculative_max_batch=max(1, args.speculative_max_batch))
    # Each run of each side in a fresh process, off and on alternated (nanoserve/bench/alternate.py
    # says why): a second engine in the same process starts from the state the first one left.
    runs = run_alternated(measure_side, {"off": (args, replace(base, speculative=None)), "on": (args, on)},
                          repeats_of(args), args.run_timeout, what="bench spec, speculation")
    if args.forced_acceptance:
        return _forced_report(args, runs)
    if args.batch_sweep:
        return _batch_report(args, runs, method)
    return _workloads_report(args, runs, method)


def measure_side(args, config) -> list[dict]:
    """One run of one side (in its own process): an engine with speculation off or on, through the
    experiment `args` ask for -> its rows, each the median of --spec-runs runs but the first (which
    warms up: it compiles this process's kernels for the prompt's shapes)."""
    from nanoserve.engine.engine import Engine

    engine = Engine(config)
    if args.forced_acceptance:
        rows = _forced_rows(args, engine)
    elif args.batch_sweep:
        rows = _batch_rows(args, engine)
    else:
        rows = _workload_rows(args, engine)
    del engine
    free_gpu()
    return rows


def _prompt_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    try:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    except ValueError:  # no chat template: the text as it is
        return tok.encode(text)


def _median_after_warmup(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs[1:] or runs)  # run 1 warms up


def _summarized_rows(runs: dict[str, list[list[dict]]], side: str) -> list[Summary]:
    """One side's runs (each a list of rows) -> for each row, its median and range over the runs."""
    return [summarize([run[j] for run in runs[side]]) for j in range(len(runs[side][0]))]


def _workload_rows(args, engine) -> list[dict]:
    rows = []
    for workload, texts in WORKLOADS.items():
        for text in texts[: args.spec_prompts]:
            prompt = _prompt_ids(engine, text)
            runs = [decode_run(engine, prompt, args.new_tokens) for _ in range(args.spec_runs)]
            last = runs[-1]
            rows.append(dict(workload=workload, prompt=text[:32].replace("\n", " "), n=last["n"],
                             tok_s=_median_after_warmup(runs, "tok_s"), acceptance=last.get("acceptance"),
                             tokens_per_step=last.get("tokens_per_step"), texts=[r["tokens"] for r in runs]))
    return rows


def _workloads_report(args, runs: dict, method: str) -> dict:
    rows, cells = [], []
    for off, on in zip(_summarized_rows(runs, "off"), _summarized_rows(runs, "on")):
        texts = [t for s in (off, on) for run in s.runs for t in run["texts"]]
        same = all(t == texts[0] for t in texts)  # greedy: speculation changes no text, in any run or process
        rows.append(dict(workload=on.median["workload"], prompt=on.median["prompt"], tokens=on.median["n"],
                         acceptance=on.median["acceptance"], tokens_per_step=on.median["tokens_per_step"],
                         off_tok_s=off.median["tok_s"], on_tok_s=on.median["tok_s"],
                         speedup=on.median["tok_s"] / off.median["tok_s"], identical=same,
                         off=as_json(off, leave_out=("texts",)), on=as_json(on, leave_out=("texts",))))
        cells.append(dict(rows[-1], acceptance=with_spread(on, "acceptance", ".2f"),
                          tokens_per_step=with_spread(on, "tokens_per_step", ".2f"),
                          off_tok_s=with_spread(off, "tok_s", ".1f"), on_tok_s=with_spread(on, "tok_s", ".1f")))
    repeats = len(runs["on"])
    print_table(f"speculative decoding at batch 1 ({method}, k={args.num_speculative_tokens}, greedy, up to "
                f"{args.new_tokens} tokens): {describe(repeats)}; in each, the median of runs 2..{args.spec_runs}",
                cells,
                [("workload", "workload", ""), ("prompt", "prompt", ""), ("tokens", "tokens", "d"),
                 ("acceptance", "accepted", ""), ("tokens_per_step", "tok/step", ""),
                 ("off_tok_s", "off tok/s", ""), ("on_tok_s", "on tok/s", ""), ("speedup", "speed-up", ".2f"),
                 ("identical", "same text", "")])
    summary = {w: statistics.median(r["speedup"] for r in rows if r["workload"] == w) for w in WORKLOADS}
    print("median speed-up: " + ", ".join(f"{w} {s:.2f}x" for w, s in summary.items()))
    result = dict(model=str(args.model), method=method, k=args.num_speculative_tokens, repeats=repeats, rows=rows,
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


def _forced_rows(args, engine) -> list[dict]:
    """Speculation off: one row, the plain decode. On: a row for each forced acceptance probability."""
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    if engine.speculator is None:
        runs = [decode_run(engine, prompt, args.new_tokens) for _ in range(args.spec_runs)]
        return [dict(tok_s=_median_after_warmup(runs, "tok_s"), step_ms=_median_after_warmup(runs, "step_ms"))]
    engine.speculator.proposer = RandomProposer(vocab)
    rows = []
    for accept in map(float, args.forced_acceptance.split(",")):
        engine.speculator.accept = forced_verify(accept)
        runs = [decode_run(engine, prompt, args.new_tokens) for _ in range(args.spec_runs)]
        rows.append(dict(accept=accept, tokens_per_step=_median_after_warmup(runs, "tokens_per_step"),
                         step_ms=_median_after_warmup(runs, "step_ms"), tok_s=_median_after_warmup(runs, "tok_s")))
    return rows


def _forced_report(args, runs: dict) -> dict:
    from nanoserve.sampling.rejection import expected_tokens_per_step

    (off,) = _summarized_rows(runs, "off")
    k, rows, cells = args.num_speculative_tokens, [], []
    for on in _summarized_rows(runs, "on"):
        accept = on.median["accept"]
        rows.append(dict(accept=accept, expected_tokens_per_step=expected_tokens_per_step(accept, k),
                         tokens_per_step=on.median["tokens_per_step"], step_ms=on.median["step_ms"],
                         tok_s=on.median["tok_s"], speedup=on.median["tok_s"] / off.median["tok_s"], on=as_json(on)))
        cells.append(dict(rows[-1], **{key: with_spread(on, key, fmt) for key, fmt in
                                       (("tokens_per_step", ".2f"), ("step_ms", ".3f"), ("tok_s", ".1f"))}))
    print(f"\nwithout speculation: {with_spread(off, 'tok_s', '.1f')} tok/s, {with_spread(off, 'step_ms', '.3f')} ms "
          "per decode step")
    print_table(f"forced acceptance, k={k}, batch 1, {args.new_tokens} tokens (each guess accepted with probability "
                f"P, whatever the target says: a timing experiment): {describe(len(runs['on']))}", cells,
                [("accept", "P", ".2f"), ("expected_tokens_per_step", "(1-P^(k+1))/(1-P)", ".2f"),
                 ("tokens_per_step", "tok/step", ""), ("step_ms", "ms/step", ""), ("tok_s", "tok/s", ""),
                 ("speedup", "speed-up", ".2f")])
    result = dict(model=str(args.model), k=k, repeats=len(runs["on"]), off_tok_s=off.median["tok_s"],
                  decode_step_ms=off.median["step_ms"], off=as_json(off), rows=rows)

    def draw(ax):
        ax.plot([r["accept"] for r in rows], [r["speedup"] for r in rows], "o-", label="measured")
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xlabel("acceptance probability per guess")
        ax.set_ylabel("batch-1 speed-up")
        ax.legend()

    save_and_plot(args, "spec_forced", result, draw)
    return result


def _batch_rows(args, engine) -> list[dict]:
    """Output tokens/s of B requests decoding together (the copy-heavy prompts, cycled), for each B."""
    from nanoserve.sampling.params import SamplingParams

    if engine.speculator is not None:
        engine.speculator.max_batch = 10**9  # this sweep decides the limit: no limit while measuring it
    prompts = [_prompt_ids(engine, t) for t in WORKLOADS["copy"]]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    device = str(engine.runner.device)
    rows = []
    for batch in map(int, args.batch_sweep.split(",")):
        speeds = []
        for _ in range(args.spec_runs):
            for i in range(batch):
                engine.add_request(prompts[i % len(prompts)], params, stream=False)
            engine.step()  # the prefills, not timed
            sync_device(device)
            start, tokens = time.perf_counter(), 0
            while engine.has_unfinished():
                tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
            sync_device(device)
            speeds.append(dict(tok_s=(tokens - batch) / (time.perf_counter() - start)))
        rows.append(dict(batch=batch, tok_s=_median_after_warmup(speeds, "tok_s")))
    return rows


def _batch_report(args, runs: dict, method: str) -> dict:
    """Speculation off and on, for each number of decodes per step: where does guessing stop paying?"""
    rows, cells = [], []
    for off, on in zip(_summarized_rows(runs, "off"), _summarized_rows(runs, "on")):
        rows.append(dict(batch=on.median["batch"], off_tok_s=off.median["tok_s"], on_tok_s=on.median["tok_s"],
                         ratio=on.median["tok_s"] / off.median["tok_s"], off=as_json(off), on=as_json(on)))
        cells.append(dict(rows[-1], off_tok_s=with_spread(off, "tok_s", ",.0f"),
                          on_tok_s=with_spread(on, "tok_s", ",.0f")))
    print_table(f"decodes together, {method} k={args.num_speculative_tokens}, copy-heavy prompts, {args.new_tokens} "
                f"tokens each: {describe(len(runs['on']))}", cells,
                [("batch", "batch", "d"), ("off_tok_s", "off tok/s", ""), ("on_tok_s", "on tok/s", ""),
                 ("ratio", "on / off", ".2f")])
    result = dict(model=str(args.model), method=method, k=args.num_speculative_tokens, repeats=len(runs["on"]),
                  rows=rows)

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
    p.add_argument("--spec-runs", type=int, default=3, help="spec: runs per prompt in each process (the first warms "
                   "up; the others' median is that process's figure; default: %(default)s)")
    p.add_argument("--spec-prompts", type=int, default=4, help="spec: prompts per workload (default: %(default)s)")


QUICK = dict(spec_runs=2, spec_prompts=1)
