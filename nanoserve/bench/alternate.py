"""Comparing two settings fairly: every run in a fresh process, the settings alternated.

`bench prefix` (caching off against on) and `bench spec` (speculation off against on) measure
through this module:

    runs = run_alternated(measure, {"off": (config_off,), "on": (config_on,)}, repeats=3)
    # the order: off 1, on 1, off 2, on 2, off 3, on 3, each `measure(config)` in its own process
    off = summarize(runs["off"])     # off.median["tok_s"]; off.spread["tok_s"] == (min, max)

Why processes: a second engine built in the same process does not start where the first one
did. It inherits the memory the first one's allocator keeps (PyTorch's caching allocator on a
GPU, malloc's arenas on a CPU), the kernels Triton and torch compiled for it, and caches and
clocks the first one warmed; so the order of the two moves the figure. Week 14 met it: caching
on ran at 0.928 of off when its engine was built second, at 1.028 when built first, around a
cost to measure of under 3% (weeks/week14/README.md, section 12). Why alternated: a machine
drifts (clocks, other jobs), and A B A B spreads the drift over both settings where A A B B
would hand it to one. The figure is the median of the runs, printed with their range: the
spread says which differences the runs can resolve. Never the best run.

Inside each process the measurement still warms up before it times (that compiles the kernels
of this process); what the process removes is the state left by the *other* setting.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import traceback
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_REPEATS = 3
DEFAULT_TIMEOUT_S = 3600.0
EXIT_GRACE_S = 60.0  # for a child to exit once it has sent its result (CUDA teardown takes a moment)

# "spawn" starts a new interpreter: "fork" would copy this process's state into the child (the
# very thing a fresh process is for), and CUDA cannot run in a child forked after the parent used it.
_SPAWN = multiprocessing.get_context("spawn")


class RunTimeout(TimeoutError):
    """A run's process sent no result within the time limit; it was killed."""


def schedule(labels: list[str], repeats: int) -> list[tuple[str, int]]:
    """The order of the runs, (label, run number from 1): the settings alternated, A1 B1 A2 B2 ..."""
    return [(label, run) for run in range(1, repeats + 1) for label in labels]


def run_alternated(measure: Callable[..., Any], configs: dict[str, tuple], repeats: int = DEFAULT_REPEATS,
                   timeout: float = DEFAULT_TIMEOUT_S, what: str = "") -> dict[str, list]:
    """`measure(*configs[label])`, `repeats` times for each label, every run in a fresh process, the
    labels alternated -> {label: [the result of each run, in the order they ran]}.

    `measure` and its arguments are pickled to the child: a function at the top level of a module,
    and plain data. A run with no result after `timeout` seconds is killed and raises RunTimeout
    naming it; an exception in the child comes back as a RuntimeError with the child's traceback."""
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: at least 1 run of each setting")
    results: dict[str, list] = {label: [] for label in configs}
    order = schedule(list(configs), repeats)
    for k, (label, run) in enumerate(order, 1):
        name = f"{what}{': ' if what else ''}{label}, run {run} of {repeats}"
        print(f"[{k}/{len(order)}] {name}, in a fresh process", flush=True)
        results[label].append(run_in_process(measure, configs[label], timeout, name))
    return results


def run_in_process(measure: Callable[..., Any], args: tuple, timeout: float, name: str) -> Any:
    """`measure(*args)` in a fresh process; its result, once the process has ended."""
    receive, send = _SPAWN.Pipe(duplex=False)
    child = _SPAWN.Process(target=_child, args=(send, measure, args), name=name)
    child.start()
    send.close()  # the child holds the only sending end: if it dies, recv() sees the end of the pipe
    try:
        if not receive.poll(timeout):
            raise RunTimeout(f"{name} sent no result within {timeout:g} s: its process was killed "
                             "(--run-timeout sets the limit)")
        try:
            ok, value = receive.recv()
        except EOFError:
            child.join(EXIT_GRACE_S)
            raise RuntimeError(f"{name}: its process ended (exit code {child.exitcode}) without a result; "
                               "its own output above says why") from None
        child.join(EXIT_GRACE_S)
    finally:
        if child.is_alive():  # hung, or slow to exit: no run outlives its turn and skews the next
            child.kill()
            child.join()
        receive.close()
    if not ok:
        raise RuntimeError(f"{name} failed in its process:\n{value}")
    return value


def _child(send, measure: Callable[..., Any], args: tuple) -> None:
    try:
        message = (True, measure(*args))
    except BaseException:  # all of it goes back to the parent, which says which run failed
        message = (False, traceback.format_exc())
    send.send(message)
    send.close()


# ------------------------------------------------------------------------- the median and the spread


@dataclass
class Summary:
    """One row of measurements over the runs of one setting."""

    runs: list[dict]  # every run's values, in the order they ran
    median: dict  # numbers: the median over the runs; anything else: the first run's value
    spread: dict[str, tuple[float, float]]  # numbers: (min, max) over the runs


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summarize(runs: list[dict]) -> Summary:
    """The median and the range of every number the runs report (a key reported as a number by
    every run), e.g. [{"tok_s": 10}, {"tok_s": 14}, {"tok_s": 11}] -> median 11, spread (10, 14)."""
    median, spread = {}, {}
    for key in runs[0]:
        values = [run.get(key) for run in runs]
        if not all(_is_number(v) for v in values):
            median[key] = values[0]
            continue
        m = statistics.median(values)
        if all(isinstance(v, int) for v in values) and m == int(m):
            m = int(m)  # counts stay counts (an even number of runs gives the mean of the middle two)
        median[key], spread[key] = m, (min(values), max(values))
    return Summary(runs, median, spread)


def with_spread(summary: Summary, key: str, fmt: str) -> str | None:
    """A table cell: '1,234 (1,200–1,260)', the median and the runs' range; the median alone when
    the runs agree to the digits shown; None (an empty cell) when there is no value."""
    value = summary.median.get(key)
    if value is None:
        return None
    if key not in summary.spread:
        return format(value, fmt)
    low, high = (format(v, fmt) for v in summary.spread[key])
    return format(value, fmt) + (f" ({low}–{high})" if low != high else "")


def as_json(summary: Summary, leave_out: tuple[str, ...] = ()) -> dict:
    """The medians, plus 'spread' ({key: [min, max]}) and 'runs' (every run's values)."""
    return dict({k: v for k, v in summary.median.items() if k not in leave_out},
                spread={k: list(v) for k, v in summary.spread.items() if k not in leave_out},
                runs=[{k: v for k, v in run.items() if k not in leave_out} for run in summary.runs])


def describe(repeats: int) -> str:
    """How a table's figures were measured, for its title."""
    if repeats == 1:
        return "one run per setting, in a fresh process"
    return (f"the median of {repeats} runs per setting, each in a fresh process, the settings alternated; "
            "min–max in brackets where the runs differ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("settings compared (prefix, spec)")
    g.add_argument("--repeats", type=int, default=None,
                   help=f"prefix, spec: runs of each setting (off, on), each in a fresh process, the settings "
                        f"alternated; the tables give the median and the range (default {DEFAULT_REPEATS})")
    g.add_argument("--run-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"prefix, spec: seconds one run's process may take before it is killed and reported "
                        f"(default {DEFAULT_TIMEOUT_S:g})")


def repeats_of(args: argparse.Namespace) -> int:
    return DEFAULT_REPEATS if args.repeats is None else args.repeats
