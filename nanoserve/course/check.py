"""`nanoserve course check`: run the tests on the learner's workspace, and say what is done.

An exercise is done when its own tests pass (the tests marked with its name: exercise_map.py),
not merely when its stub is gone: a written but broken exercise is not done. The exercises are
listed in the order their lesson teaches them, and the first one that is not done is the one
the report points to.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nanoserve.course import exercise_map
from nanoserve.course.stubs import ENV_VAR
from nanoserve.course.workspace import REPO_DIR, exercise_status, weeks_with_exercises

CORE_WEEKS = 11  # weeks 1 to 11 are the core of the course; the capstone needs them, not the bonus weeks
CAPSTONE = "weeks/capstone/README.md"
# What `check` with no week costs with every week written, said before it starts so that nobody
# waits blind: the fast tests of weeks 1 to 17 took 27 minutes in all on a 2-core machine busy
# with other work (tests/course/test_workspace.py runs each of them on its workspace).
ALL_WEEKS_MINUTES = 30
SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR) (\S+\.py(?:::.*?)?)(?: - (.*))?$")  # pytest -rfEp's lines
PROGRESS = ".FEsxX"  # what pytest -q prints for each test as it runs
RUN_LIMIT_S = 1800  # one pytest run of `run_tests` is stopped after this; a week's fast tests take minutes


def command(tool: str) -> str:
    """How the learner runs `tool` ('nanoserve' or 'pytest') from where they are: its bare name
    when their shell finds this Python environment's copy (an activated virtualenv), else the
    path to that copy (`.venv/bin/nanoserve`), else this Python with `-m`. A hint that prints
    `python -m ...` fails outside an activated virtualenv, where `python` is another Python."""
    bindir = Path(sys.executable).parent  # not resolved: a virtualenv's python is a symlink
    mine = bindir / tool
    found = shutil.which(tool)
    if found and mine.exists() and Path(found).resolve() == mine.resolve():
        return tool
    if mine.exists():
        return _shell_path(mine)
    return f"{_shell_path(Path(sys.executable))} -m {'nanoserve.cli' if tool == 'nanoserve' else tool}"


def _shell_path(path: Path) -> str:
    """A path to type in the shell: relative to the working directory if inside it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def course_command(args: str) -> str:
    return f"{command('nanoserve')} course {args}"


# --------------------------------------------------------------------------- running the tests


@dataclass
class PytestRun:
    returncode: int
    output: str
    outcomes: dict[str, str] = field(default_factory=dict)  # node id -> 'PASSED' / 'FAILED' / 'ERROR'
    messages: dict[str, str] = field(default_factory=dict)  # node id -> the failure's one-line message

    @property
    def summary(self) -> str:
        lines = [line for line in self.output.strip().splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
        return lines[-1].strip("= ") if lines else "no tests ran"


def run_tests(targets: list[str], workspace: Path | None, extra: list[str] | None = None,
              echo: Callable[[str], None] | None = None, limit_s: float = RUN_LIMIT_S) -> PytestRun:
    """Run pytest on `targets` (folders, files or node ids; fast tests only) against a workspace
    (or the reference if None), in a fresh interpreter so that `import nanoserve` finds it.
    `echo` gets pytest's progress characters (`.`, `F`, ...) as they come: a run takes minutes.
    A run still going after `limit_s` is killed, and its output says so; 30 s before that, pytest's
    faulthandler prints every thread's stack, which is where it hung."""
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if workspace is not None:
        env[ENV_VAR] = str(Path(workspace).resolve())
    env["COLUMNS"] = "1000"  # the short summary cuts each failure's message at the terminal's width
    cmd = [sys.executable, "-m", "pytest", *targets, "-m", "not slow", "-q", "-p", "no:cacheprovider",
           "--tb=line", "-rfEp", "--continue-on-collection-errors",
           "-o", f"faulthandler_timeout={max(1, int(limit_s) - 30)}"] + (extra or [])
    proc = subprocess.Popen(cmd, cwd=REPO_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = threading.Event()

    def stop() -> None:  # the read below ends when the killed process's pipe closes
        stopped.set()
        proc.kill()

    watchdog = threading.Timer(limit_s, stop)
    watchdog.start()
    chars, line, reports = [], "", False
    try:
        for ch in iter(lambda: proc.stdout.read(1), ""):
            chars.append(ch)
            line = "" if ch == "\n" else line + ch
            reports = reports or line == "="  # the "=====" line after the progress: the reports begin
            if echo is not None and not reports and ch in PROGRESS and not line.strip(PROGRESS):
                echo(ch)
    except BaseException:  # Ctrl-C or an echo that raised: the child pytest must not outlive this call
        proc.kill()
        raise
    finally:
        watchdog.cancel()
    code = proc.wait()
    if stopped.is_set():
        chars.append(f"\nnanoserve check: pytest {' '.join(targets)} ran past {limit_s:g} s and was stopped"
                     " (the stacks above, from pytest's faulthandler, show where it hung)\n")
    run = PytestRun(code, "".join(chars))
    summary = run.output[run.output.rfind("short test summary info"):]  # not the tests' own output
    for line in summary.splitlines():
        m = SUMMARY.match(line)
        if m:
            run.outcomes[m[2]] = m[1]
            run.messages[m[2]] = m[3] or ""
    return run


def run_week_tests(week: int, workspace: Path | None, extra: list[str] | None = None,
                   echo: Callable[[str], None] | None = None) -> PytestRun:
    """Run tests/weekNN (fast tests only) against a workspace (or the reference if None)."""
    return run_tests([f"tests/week{week:02d}"], workspace, extra, echo)


def dots(ch: str) -> None:
    """An `echo` for run_tests: pytest's progress on this terminal, as it comes."""
    print(ch, end="", flush=True)


# ------------------------------------------------------------------------------ the verdicts


@dataclass
class Verdict:
    """One exercise after a run: written or a stub, and how its own tests did."""

    week: int
    name: str
    written: bool
    passed: list[str]  # node ids of its tests that passed
    failed: list[str]  # ... that failed or errored
    shared_with: list[str] = field(default_factory=list)  # the other exercises its first failed test checks

    @property
    def done(self) -> bool:
        return self.written and bool(self.passed) and not self.failed

    @property
    def open(self) -> bool:
        """Still to do: a stub, or a failing test. (Written with no test run, all skipped here,
        is neither done nor open: `[?]`.)"""
        return not self.written or bool(self.failed)

    def line(self) -> str:
        if not self.written:
            return f"  [ ] {self.name}   (still a stub)"
        if self.failed:
            first = self.failed[0].split("::")[-1]
            return f"  [ ] {self.name}   (written; {len(self.failed)} of its tests fail, first {first}{self.also()})"
        if not self.passed:
            return f"  [?] {self.name}   (written; none of its tests ran here)"
        return f"  [x] {self.name}"

    def also(self) -> str:
        """A failed test that checks several exercises cannot say which one is wrong: say so."""
        return f", which also checks {', '.join(map(repr, self.shared_with))}" if self.shared_with else ""


def verdicts(week: int, workspace: Path, run: PytestRun, only: str | None = None) -> list[Verdict]:
    """The week's exercises (or exercise `only`) in the lesson's order, with their tests' outcomes."""
    written = dict(exercise_status(week, workspace))
    marked = exercise_map.marked_tests()
    out = []
    for name in exercise_map.lesson_order(week, list(written)):
        if only is not None and name != only:
            continue
        mine = exercise_map.tests_of(week, name, marked)
        ran = {node: outcome for node, outcome in run.outcomes.items() if any(t.covers(node) for t in mine)}
        failed = [n for n, o in ran.items() if o != "PASSED"]
        shared = sorted({other for t in marked if t.week == week and failed and t.covers(failed[0])
                         for other in t.exercises if other != name})
        out.append(Verdict(week, name, written[name], [n for n, o in ran.items() if o == "PASSED"], failed, shared))
    return out


def first_failure(found: list[Verdict], run: PytestRun) -> str | None:
    """The first exercise in the lesson's order that is not done, said in one line; else the
    first failing test that belongs to no exercise (a test of the whole week)."""
    for v in found:
        if not v.written:
            return f"exercise '{v.name}' of week {v.week} is still a stub"
        if v.failed:
            return (f"exercise '{v.name}' of week {v.week}: {v.failed[0]} failed{v.also()}: "
                    f"{run.messages[v.failed[0]]}")
    for node, outcome in run.outcomes.items():
        if outcome != "PASSED":
            return f"{node} failed: {run.messages[node]}"
    return None


# ------------------------------------------------------------------------------ the commands


def last_week() -> int:
    return max(weeks_with_exercises())


def known_week(week: int) -> bool:
    """Whether `week` is a week of the course; if not, say which are (and that the capstone follows)."""
    weeks = weeks_with_exercises()
    if week in weeks:
        return True
    print(f"there is no week {week}: the weeks are {weeks[0]} to {weeks[-1]}, then the capstone ({CAPSTONE})",
          file=sys.stderr)
    return False


def next_step_after(week: int) -> str:
    """What to do once `week` passes: the next week, or the capstone after the last one."""
    if week >= last_week():
        return (f"That was the last week of the course. Next: the capstone, {CAPSTONE}: serve a real model "
                "with your engine, to stated targets.")
    start = f"`{course_command(f'start --week {week + 1}')}`, then read weeks/week{week + 1:02d}/README.md"
    if week == CORE_WEEKS:
        return (f"The core of the course is done: the capstone ({CAPSTONE}) is open to you. The bonus weeks "
                f"go on: {start}.")
    return f"Next: {start}."


def full_details(nodes: list[str], workspace: Path) -> str:
    return f"`{ENV_VAR}={workspace} {command('pytest')} {' '.join(nodes)} -x`"


def check(week: int, workspace: Path) -> bool:
    """`check --week N`: the week's fast tests, then each exercise in the lesson's order."""
    if not (workspace / "nanoserve").exists():
        print(f"no workspace at {workspace}: run `{course_command(f'start --week {week}')}` first")
        return False
    print(f"Week {week}: running tests/week{week:02d} on {workspace / 'nanoserve'} ", end="", flush=True)
    run = run_week_tests(week, workspace, echo=dots)
    print()
    found = verdicts(week, workspace, run)
    print(f"Exercises, in the order of weeks/week{week:02d}/README.md:")
    for v in found:
        print(v.line())
    print(f"Tests: {run.summary}")
    if run.returncode == 0 and not any(v.open for v in found):
        print(f"Week {week} passes. {next_step_after(week)}")
        return True
    failure = first_failure(found, run)
    if failure:
        print(f"First failure: {failure}")
    todo = next((v for v in found if v.open), None)
    if todo is not None:
        print(f"Next step: exercise '{todo.name}' (its section in weeks/week{week:02d}/README.md); "
              f"`{course_command(f'check --exercise {todo.name}')}` runs its tests alone.")
    else:
        print(f"Next step: read weeks/week{week:02d}/README.md and run {full_details([f'tests/week{week:02d}'], workspace)}.")
    compare = f"; `{command('nanoserve')} compare` names the first layer that differs from HuggingFace" if week == 2 else ""
    print(f"Stuck? `{course_command('peek NAME')}` shows a solution{compare}.")
    return False


def check_exercise(week: int, name: str, workspace: Path) -> bool:
    """`check --exercise NAME`: that exercise's own fast tests only."""
    if not (workspace / "nanoserve").exists():
        print(f"no workspace at {workspace}: run `{course_command(f'start --week {week}')}` first")
        return False
    nodes = [t.nodeid for t in exercise_map.tests_of(week, name) if t.fast]
    print(f"Exercise '{name}' of week {week}: running its tests on {workspace / 'nanoserve'}:", flush=True)
    for node in nodes:
        print(f"  {node}")
    run = run_tests(nodes, workspace, echo=dots)
    print()
    (v,) = verdicts(week, workspace, run, only=name)
    print(f"Tests: {run.summary}")
    print(v.line())
    order = exercise_map.lesson_order(week, [n for n, _ in exercise_status(week, workspace)])
    after = order[order.index(name) + 1:]
    if v.done:
        nxt = f"exercise '{after[0]}'" if after else f"the whole week: `{course_command(f'check --week {week}')}`"
        print(f"'{name}' is done. Next: {nxt}.")
        return True
    failure = first_failure([v], run)
    if failure:
        print(f"First failure: {failure}")
    print(f"Full details: {full_details(nodes, workspace)}; stuck? `{course_command(f'peek {name}')}`.")
    return False


def progress(workspace: Path) -> bool:
    """`check` with no week: every week's fast tests in turn, one line each. Says first what it
    is about to run and about how long it takes."""
    if not (workspace / "nanoserve").exists():
        print(f"no workspace at {workspace}: run `{course_command('start --week 1')}` first")
        return False
    weeks = weeks_with_exercises()
    print(f"Running the fast tests of weeks {weeks[0]} to {weeks[-1]}, one week after another, on "
          f"{workspace / 'nanoserve'}: with every week written, up to about {ALL_WEEKS_MINUTES} minutes on a "
          f"2-core machine; a week not started is skipped. `{course_command('check --week N')}` checks one week.",
          flush=True)
    print(f"{'week':>4}  {'exercises done':>14}  tests")
    first_open = None
    for week in weeks:
        written = [w for _, w in exercise_status(week, workspace)]
        if not any(written):  # only stubs: its tests could only fail
            first_open = first_open or week
            print(f"{week:>4}  {0:>7}/{len(written):<6}  not started")
            continue
        run = run_week_tests(week, workspace)
        found = verdicts(week, workspace, run)
        done = sum(v.done for v in found)
        ok = run.returncode == 0 and not any(v.open for v in found)
        first_open = first_open or (None if ok else week)
        print(f"{week:>4}  {done:>7}/{len(found):<6}  {'pass' if ok else 'FAIL'}: {run.summary}", flush=True)
    if first_open is None:
        print(f"Every week passes. {next_step_after(weeks[-1])}")
        return True
    print(f"The first week to finish is week {first_open}: `{course_command(f'check --week {first_open}')}` "
          "says which exercise.")
    return False
