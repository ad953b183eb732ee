"""Week 8: the queueing simulator: stable and unstable regimes, Little's law."""

from nanoserve.scheduler.simulator import SimConfig, simulate


def test_stable_regime_obeys_littles_law():
    cfg = SimConfig(arrival_rate=4.0, max_running=8, step_time=0.02, output_len=(20, 100), num_requests=2000)
    assert cfg.arrival_rate < 0.7 * cfg.capacity  # capacity = 8 / (60 * 0.02) = 6.7 requests/s
    res = simulate(cfg)
    mean_latency = sum(res.latencies) / len(res.latencies)
    little = res.arrival_rate * mean_latency
    assert abs(res.mean_in_system - little) / little < 0.1, (res.mean_in_system, little)
    assert res.percentile(res.ttfts, 50) < 5 * cfg.step_time  # barely any queueing
    assert abs(res.throughput - cfg.arrival_rate * 60) / (cfg.arrival_rate * 60) < 0.1


def test_unstable_regime_queue_grows():
    cfg = SimConfig(arrival_rate=12.0, max_running=8, step_time=0.02, output_len=(20, 100), num_requests=2000)
    assert cfg.arrival_rate > cfg.capacity
    res = simulate(cfg)
    last_arrival = res.requests[-1].arrival

    def waiting_at(t):
        return [w for time, w, _ in res.timeline if time <= t][-1]

    # While requests keep coming, the backlog keeps growing (about linearly in time).
    assert waiting_at(last_arrival) > 2 * waiting_at(last_arrival / 3) > 0
    ttft = res.ttfts
    assert sum(ttft[-100:]) / 100 > 10 * sum(ttft[:100]) / 100  # latecomers wait far longer
    # The engine runs flat out: throughput is capped near its capacity, whatever the demand.
    assert res.throughput < 1.05 * cfg.capacity * 60


def test_continuous_beats_static_on_latency():
    common = dict(arrival_rate=4.0, max_running=8, step_time=0.02, num_requests=1000, output_len=(10, 200))
    static = simulate(SimConfig(batching="static", **common))
    continuous = simulate(SimConfig(batching="continuous", **common))
    assert continuous.percentile(continuous.ttfts, 50) < static.percentile(static.ttfts, 50)
    assert continuous.percentile(continuous.latencies, 99) < static.percentile(static.latencies, 99)


def test_the_scheduler_and_the_simulator_need_no_torch():
    """Scheduling is bookkeeping: importing it must not pull in torch (a worker-free driver, the
    simulator and the scheduler's tests run on plain integers)."""
    import subprocess
    import sys

    code = "import sys, nanoserve.scheduler, nanoserve.scheduler.simulator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
