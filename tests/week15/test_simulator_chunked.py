"""Week 15 in week 8's queueing simulator: the scheduler with chunked prefill on, a simulated
clock whose steps grow with the prompt tokens they carry, and the trade the token budget makes
between the time to first token and the gaps between tokens."""

import pytest

from nanoserve.scheduler.simulator import SimConfig, simulate

# Long prompts among long outputs, with a step time of 5 ms plus 50 us per prompt token: a step
# that prefills a 1,000-token prompt takes 55 ms instead of 5 ms, for everyone in it.
WORKLOAD = dict(arrival_rate=8.0, max_running=32, step_time=0.005, prefill_time_per_token=0.00005,
                prompt_len=(100, 1024), output_len=(100, 512), num_requests=300)


def run(budget=None):
    if budget is None:
        return simulate(SimConfig(**WORKLOAD))
    return simulate(SimConfig(chunked_prefill=True, max_num_batched_tokens=budget, **WORKLOAD))


def test_every_chunk_costs_its_tokens():
    """One request alone: a 1,025-token prompt under a budget of 64 runs in 17 chunks (the last
    one of a single token), and its first token comes after 17 steps and all 1,025 tokens."""
    cfg = SimConfig(arrival_rate=1.0, num_requests=1, prompt_len=(1025, 1025), output_len=(4, 4),
                    step_time=0.005, prefill_time_per_token=0.00005, chunked_prefill=True,
                    max_num_batched_tokens=64)
    (r,) = simulate(cfg).requests
    steps = -(-1025 // 64)
    assert r.first_token - r.arrival == pytest.approx(steps * cfg.step_time + 1025 * cfg.prefill_time_per_token)
    assert [b - a for a, b in zip(r.token_times, r.token_times[1:])] == pytest.approx([cfg.step_time] * 3)


def test_chunking_lowers_the_itl_tail():
    whole, chunked = run(), run(budget=256)
    assert chunked.percentile(chunked.itls, 99) < 0.6 * whole.percentile(whole.itls, 99)
    # The work is the same, only spread differently: the same tokens in about the same time.
    assert chunked.throughput == pytest.approx(whole.throughput, rel=0.02)


def test_a_smaller_budget_trades_ttft_for_itl():
    budgets = [512, 256, 128]
    runs = [run(budget=b) for b in budgets]
    itl_p99 = [r.percentile(r.itls, 99) for r in runs]
    ttft_p50 = [r.percentile(r.ttfts, 50) for r in runs]
    assert itl_p99 == sorted(itl_p99, reverse=True) and len(set(itl_p99)) == len(budgets), itl_p99
    assert ttft_p50 == sorted(ttft_p50) and len(set(ttft_p50)) == len(budgets), ttft_p50
    # A decode step's time is the floor under every gap, whatever the budget.
    assert min(min(r.itls) for r in runs) >= WORKLOAD["step_time"] - 1e-12
