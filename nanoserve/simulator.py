"""A discrete-event simulator of the engine loop: queueing, without a model.

Requests arrive at random (a Poisson process), wait in a queue, run for as many steps as they
have output tokens, and leave. Each engine step takes a fixed time (plus a cost per prompt token
prefilled in it). This is enough to see the two regimes every server lives in:

- *stable*: requests arrive slower than the engine can finish them; the queue stays short and
  time-to-first-token is about one step;
- *unstable*: they arrive faster; the queue, and everyone's waiting time, grows without bound.

The engine can finish at most `max_running / (mean_output_tokens * step_time)` requests per
second: that is the line between the two. Little's law (L = lambda * W: the mean number of
requests in the system equals the arrival rate times the mean time each spends in it) holds in
the stable regime and makes a good check on the simulation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field



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
    policy: str = "continuous"  # or "static"
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


@dataclass
class SimResult:
    requests: list[SimRequest]
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (time, waiting, running)
    duration: float = 0.0

    @property
    def ttfts(self) -> list[float]:
        return [r.first_token - r.arrival for r in self.requests]

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


def simulate(cfg: SimConfig) -> SimResult:
    rng = random.Random(cfg.seed)
    t, arrivals = 0.0, []
    for _ in range(cfg.num_requests):
        t += rng.expovariate(cfg.arrival_rate)
        arrivals.append(SimRequest(t, rng.randint(*cfg.prompt_len), rng.randint(*cfg.output_len)))

    result = SimResult(arrivals)
    queue: list[SimRequest] = []
    running: list[SimRequest] = []
    now, next_arrival, done = 0.0, 0, 0
    while done < len(arrivals):
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival <= now:
            queue.append(arrivals[next_arrival])
            next_arrival += 1
        if not running and not queue:  # idle: record it, then jump to the next arrival
            result.timeline.append((now, 0, 0))
            now = arrivals[next_arrival].arrival
            continue
        admitted: list[SimRequest] = []
        if cfg.policy == "continuous" or not running:  # static admits only into an empty batch
            while queue and len(running) < cfg.max_running:
                admitted.append(queue.pop(0))
                running.append(admitted[-1])
        result.timeline.append((now, len(queue), len(running)))
        now += cfg.step_time + cfg.prefill_time_per_token * sum(r.prompt_len for r in admitted)
        for r in running:  # every running request gets one token at the end of the step
            r.generated += 1
            if r.first_token is None:
                r.first_token = now
            if r.generated == r.output_len:
                r.finish = now
                done += 1
        running = [r for r in running if r.finish is None]
    result.timeline.append((now, len(queue), len(running)))
    result.duration = now - arrivals[0].arrival
    return result
