"""A discrete-event simulator of the engine loop: queueing, without a model.

Requests arrive at random (a Poisson process), wait in a queue, run for as many steps as they
have output tokens, and leave. Each engine step takes a fixed time, plus a cost per prompt token
prefilled in it: a step's time grows with the prompt tokens it carries, as on a real GPU, where a
decode step is bound by reading the weights and a prefill by its arithmetic. This is enough to
see the two regimes every server lives in:

- *stable*: requests arrive slower than the engine can finish them; the queue stays short and
  time-to-first-token is about one step;
- *unstable*: they arrive faster; the queue, and everyone's waiting time, grows without bound.

The scheduling decisions are the real ones: the simulator drives nanoserve's own `Scheduler`
(static or continuous batching, its limits, its FCFS order) with a fake model that returns one
token per sequence per step; only the clock is simulated.

With `chunked_prefill` (week 15) the scheduler gives each step's token budget to the decodes
first and cuts prompts to fit the rest: steps get shorter, and the gaps between a request's
tokens (`SimResult.itls`) with them, at the price of a later first token for long prompts.

The engine can finish at most `max_running / (mean_output_tokens * step_time)` requests per
second: that is the line between the two. Little's law (L = lambda * W: the mean number of
requests in the system equals the arrival rate times the mean time each spends in it) holds in
the stable regime and makes a good check on the simulation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.blocks import blocks_needed
from nanoserve.scheduler.scheduler import Scheduler
from nanoserve.scheduler.sequence import Batch, Sequence


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile of `values` (the value below which p% of them fall; nan if empty)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else float("nan")

@dataclass
class SimConfig:
    arrival_rate: float  # requests per second
    max_running: int = 8  # sequences in the running set at most
    step_time: float = 0.02  # seconds per engine step
    prefill_time_per_token: float = 0.0  # extra seconds per prompt token prefilled in a step
    prompt_len: tuple[int, int] = (50, 200)  # uniform, inclusive
    output_len: tuple[int, int] = (20, 100)
    num_requests: int = 500
    batching: str = "continuous"  # or "static"
    max_num_batched_tokens: int = 1 << 30  # the scheduler's token budget per step (default: none)
    chunked_prefill: bool = False  # week 15: decodes first, prompts cut to fit the budget
    block_size: int = 16
    num_blocks: int | None = None  # KV pool; default: room for max_running of the longest requests
    seed: int = 0

    @property
    def capacity(self) -> float:
        """Requests per second the engine can finish when always full (ignoring prefill)."""
        mean_out = sum(self.output_len) / 2
        return self.max_running / (mean_out * self.step_time)


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    first_token: float | None = None
    finish: float | None = None
    generated: int = 0
    token_times: list[float] = field(default_factory=list)  # when each output token came out


@dataclass
class SimResult:
    requests: list[SimRequest]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (time, waiting, running)
    duration: float = 0.0

    @property
    def ttfts(self) -> list[float]:
        return [r.first_token - r.arrival for r in self.requests]

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive tokens of each request, all together."""
        return [b - a for r in self.requests for a, b in zip(r.token_times, r.token_times[1:])]

    @property
    def latencies(self) -> list[float]:
        return [r.finish - r.arrival for r in self.requests]

    def percentile(self, values: list[float], p: float) -> float:
        return percentile(values, p)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return sum(r.output_len for r in self.requests) / self.duration

    @property
    def arrival_rate(self) -> float:
        arrivals = [r.arrival for r in self.requests]
        return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])

    @property
    def mean_in_system(self) -> float:
        """L: the time-average number of requests waiting or running."""
        area = 0.0
        for (t0, w, r), (t1, _, _) in zip(self.timeline, self.timeline[1:]):
            area += (w + r) * (t1 - t0)
        return area / (self.timeline[-1][0] - self.timeline[0][0])


def prefill_tokens(batch: Batch) -> int:
    """The tokens of a step that are not decodes: whole prompts, prompt chunks (week 15) and the
    tokens a preempted sequence recomputes. A decode runs the one token sampled in the step before."""
    return sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens)
               if not (n == 1 and seq.num_output_tokens and seq.num_computed == seq.num_tokens - 1))


def simulate(cfg: SimConfig) -> SimResult:
    rng = random.Random(cfg.seed)
    t, arrivals = 0.0, []
    for _ in range(cfg.num_requests):
        t += rng.expovariate(cfg.arrival_rate)
        arrivals.append(SimRequest(t, rng.randint(*cfg.prompt_len), rng.randint(*cfg.output_len)))

    longest = cfg.prompt_len[1] + cfg.output_len[1]
    num_blocks = cfg.num_blocks or cfg.max_running * blocks_needed(longest, cfg.block_size)
    scheduler = Scheduler(num_blocks, cfg.block_size, max_num_seqs=cfg.max_running,
                          max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=longest,
                          batching=cfg.batching, chunked_prefill=cfg.chunked_prefill)
    result = SimResult(arrivals)
    request_of: dict[int, SimRequest] = {}
    now, next_arrival, done = 0.0, 0, 0
    while done < len(arrivals):
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival <= now:
            r = arrivals[next_arrival]
            seq = Sequence([0] * r.prompt_len, SamplingParams(temperature=0, max_tokens=r.output_len))
            request_of[seq.seq_id] = r
            scheduler.add(seq)
            next_arrival += 1
        if not scheduler.has_unfinished():  # idle: record it, then jump to the next arrival
            result.timeline.append((now, 0, 0))
            now = arrivals[next_arrival].arrival
            continue
        batch = scheduler.schedule()
        result.timeline.append((now, len(scheduler.waiting), len(scheduler.running)))
        now += cfg.step_time + cfg.prefill_time_per_token * prefill_tokens(batch)
        scheduler.update(batch, [[0] * n for n in batch.num_samples])  # the fake model's tokens
        for seq in batch.seqs:
            r = request_of[seq.seq_id]
            r.token_times += [now] * (seq.num_output_tokens - r.generated)
            r.generated = seq.num_output_tokens
            if r.first_token is None and r.generated:
                r.first_token = now
            if seq.is_finished:
                r.finish = now
                done += 1
    result.timeline.append((now, len(scheduler.waiting), len(scheduler.running)))
    result.duration = now - arrivals[0].arrival
    return result
