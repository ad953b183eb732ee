"""Issue 38, week 25 section 2: what a tool loop's rounds cost when each resumes from the last one's
held KV, against prefilling each round's whole prompt again (a client-driven loop on a server
without a prefix cache).

    python scripts/bench_tool_loop.py                      # SmolLM2-135M-Instruct, float32, CPU
    python scripts/bench_tool_loop.py --model tiny --rounds 4 --reps 3

One agent's turn, on the engine alone (no HTTP): a system prompt listing tools and a question; each
round the model answers (greedy, `--max-tokens`), and a tool's result (about `--result-tokens`
tokens, in the Hermes `<tool_response>` turn that `--tool-template hermes` writes) is appended.
Round k's prompt is round k-1's prompt + its answer + the result. Two ways to run the same rounds,
prefix caching OFF in both, so that nothing but held KV is reused:

  resume     every round with hold_kv=True, and resume_from = the last round's request id
  prefill    every round a fresh request: its whole prompt prefilled

Per round: the prompt's tokens, the tokens prefilled (prompt - `num_cached_tokens`), and the time to
the round's first output token (the engine's own stamps: first token - arrival), the median of
`--reps` repetitions, the two ways alternated. The answers of the two ways are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from nanoserve.engine.engine import LLM
from nanoserve.sampling.params import SamplingParams

SYSTEM = ("You are a travel assistant. You can call these tools, one call per turn, and you read their results "
          "before you answer. Be brief and precise.\n<tools>\n" + "\n".join(json.dumps({
              "type": "function", "function": {"name": name, "description": what, "parameters": {
                  "type": "object", "properties": {"city": {"type": "string"}, "date": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}}}) for name, what in [
              ("get_weather", "The weather forecast for a city on a date."),
              ("find_hotels", "Hotels in a city with free rooms on a date, cheapest first."),
              ("find_trains", "Trains to a city on a date, with times and prices."),
              ("local_events", "Concerts, exhibitions and markets in a city on a date.")]) + "\n</tools>")
QUESTION = "I am going to Lyon next Saturday. What should I pack, where can I stay, and what is on?"
CITIES = ["Lyon", "Paris", "Geneva", "Turin", "Marseille", "Dijon", "Grenoble", "Annecy"]


def tool_result(k: int, result_tokens: int, tokenizer) -> list[int]:
    """Round k's tool result as the next turn of the conversation, about `result_tokens` tokens."""
    rows, text = [], ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < result_tokens:
        i = len(rows)
        rows.append({"name": f"{CITIES[(k + i) % len(CITIES)]} option {i + 1}", "price_eur": 40 + 13 * i + 7 * k,
                     "rating": round(3.1 + ((i * 7 + k) % 19) / 10, 1), "note": "free cancellation" if i % 2 else "central"})
        text = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n" + json.dumps({"results": rows})
                + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    return tokenizer.encode(text, add_special_tokens=False)


def run(llm: LLM, prompt: list[int], params: SamplingParams, hold: bool, resume_from: int | None):
    """One round to its end: (its finished output, its TTFT in seconds)."""
    engine = llm.engine
    rid = engine.add_request(prompt, params, stream=False, hold_kv=hold, resume_from=resume_from)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                last = out
    m = last.metrics
    return last, m.token_times[0] - m.arrival_time


def turn(llm: LLM, prompts: list[list[int]], params: SamplingParams, resume: bool):
    """Every round of the turn: [(prompt tokens, prefilled tokens, ttft, answer ids)] per round."""
    rows, held = [], None
    for prompt in prompts:
        out, ttft = run(llm, prompt, params, hold=resume, resume_from=held if resume else None)
        held = out.request_id if resume else None
        rows.append((len(prompt), len(prompt) - out.num_cached_tokens, ttft, out.token_ids))
    if held is not None:
        llm.engine.release_held(held)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=12, help="each round's answer (greedy)")
    ap.add_argument("--result-tokens", type=int, default=120, help="each tool result, about")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a small shared CPU, more threads than free cores stall each step)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    llm = LLM(args.model, device="cpu", dtype=torch.float32, enable_prefix_caching=False)
    tok, params = llm.tokenizer, SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # The rounds' prompts, built once from the model's own answers (greedy: the same in both ways).
    prompts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])]
    for k in range(args.rounds - 1):
        out, _ = run(llm, prompts[-1], params, hold=False, resume_from=None)
        prompts.append(prompts[-1] + out.token_ids + tool_result(k, args.result_tokens, tok))
    turn(llm, prompts[:2], params, resume=True)  # warm-up
    got = {"resume": [], "prefill": []}
    for _ in range(args.reps):
        for way in ("prefill", "resume"):
            got[way].append(turn(llm, prompts, params, resume=way == "resume"))
    same = all(a[3] == b[3] for rep_a, rep_b in zip(got["resume"], got["prefill"]) for a, b in zip(rep_a, rep_b))

    def med(way: str, k: int, i: int) -> float:
        return statistics.median(rep[k][i] for rep in got[way])

    def spread(way: str, k: int) -> str:  # a round's TTFT, lowest to highest over the repetitions, in ms
        times = [rep[k][2] * 1e3 for rep in got[way]]
        return f"{min(times):,.0f}–{max(times):,.0f}"

    print(f"model {args.model}, float32, CPU ({torch.get_num_threads()} torch thread(s)), prefix caching off, "
          f"{args.rounds} rounds, answers of {args.max_tokens} tokens, tool results of about {args.result_tokens} "
          f"tokens, median of {args.reps}; answers equal in both ways: {same}")
    print("| round | prompt tokens | prefilled, resume | prefilled, re-prefill | TTFT resume (ms) "
          "| TTFT re-prefill (ms) | TTFT ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")  # TTFT: median (lowest–highest)
    totals = [0, 0, 0, 0.0, 0.0]
    for k in range(args.rounds):
        p, a, b = med("resume", k, 0), med("resume", k, 1), med("prefill", k, 1)
        ta, tb = med("resume", k, 2) * 1e3, med("prefill", k, 2) * 1e3
        for i, v in enumerate((p, a, b, ta, tb)):
            totals[i] += v
        print(f"| {k} | {p:,.0f} | {a:,.0f} | {b:,.0f} | {ta:,.0f} ({spread('resume', k)}) "
              f"| {tb:,.0f} ({spread('prefill', k)}) | {tb / ta:.1f} |")
    p, a, b, ta, tb = totals
    print(f"| all | {p:,.0f} | {a:,.0f} | {b:,.0f} | {ta:,.0f} | {tb:,.0f} | {tb / ta:.1f} |")


if __name__ == "__main__":
    main()
