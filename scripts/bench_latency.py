"""Batch-1 decode latency: nanoserve and HuggingFace side by side, against the bandwidth roofline.

    python scripts/bench_latency.py --model /tmp/llama1b --out docs/bench

One request at a time: a prompt of --prompt-len random token ids, then --new-tokens greedy tokens
with EOS ignored. Decode speed = (new tokens - 1) / (time from the first token to the last), so
the prefill is left out. The roofline is the speed at which a decode step could go if it did
nothing but read every weight once at the GPU's measured copy bandwidth:
    tokens/s <= copy bandwidth (bytes/s) / weight bytes.
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def copy_bandwidth(nbytes: int = 2**30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 20 / (time.perf_counter() - start)  # bytes read + written per second


def nanoserve_decode(model: str, prompt: list[int], new_tokens: int, profile: bool = False) -> tuple[float, int, str]:
    from nanoserve.engine import Engine
    from nanoserve.sampling import SamplingParams

    engine = Engine(model, kv_cache_memory=4 * 2**30)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(2):  # the first run compiles kernels
        engine.add_request(prompt, params)
        times = []
        while engine.has_unfinished():
            engine.step()
            times.append(time.perf_counter())
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    label = "nanoserve (CUDA graphs)" if engine.runner.graph_decoder is not None else "nanoserve (eager)"
    if profile:  # where the time of a decode step goes
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        engine.add_request(prompt, params)
        engine.step()  # prefill
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                engine.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        engine.abort(next(iter(engine.requests)))
    del engine
    torch.cuda.empty_cache()
    return (new_tokens - 1) / (times[-1] - times[0]), weights, label


def hf_decode(model: str, prompt: list[int], new_tokens: int) -> float:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    results = []
    for n in (2, new_tokens):  # time a 2-token run to subtract the prefill
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        results.append(elapsed)
    del hf
    torch.cuda.empty_cache()
    return (new_tokens - 2) / (results[1] - results[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--profile", action="store_true", help="print a torch profile of 20 decode steps")
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 100000) for _ in range(args.prompt_len)]
    bandwidth = copy_bandwidth()
    ours, weight_bytes, label = nanoserve_decode(args.model, prompt, args.new_tokens, args.profile)
    theirs = hf_decode(args.model, prompt, args.new_tokens)
    roofline = bandwidth / weight_bytes
    rows = [dict(engine=label, tok_s=ours, ms_per_token=1e3 / ours, pct_roofline=100 * ours / roofline),
            dict(engine="HF transformers generate", tok_s=theirs, ms_per_token=1e3 / theirs,
                 pct_roofline=100 * theirs / roofline)]
    print(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"-> roofline {roofline:.0f} tok/s ({1e3 / roofline:.2f} ms/token)")
    for r in rows:
        print(f"{r['engine']:>26}: {r['tok_s']:7.1f} tok/s  {r['ms_per_token']:6.2f} ms/token  "
              f"{r['pct_roofline']:5.1f}% of roofline")
    from bench_common import save_result

    save_result(args.out, "latency", model=args.model, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                weight_bytes=weight_bytes, copy_gbs=bandwidth / 1e9, roofline_tok_s=roofline, rows=rows)


if __name__ == "__main__":
    main()
