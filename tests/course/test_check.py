"""`nanoserve course check`, `reset` and their hints, as a learner meets them.

Most tests here replace the pytest run with a made-up one (`fake_runs`): what is under test is
what `check` concludes from the outcomes and says, not pytest. Two run the real tests of one week
or one exercise end to end.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from nanoserve.course import check as checking
from nanoserve.course import exercise_map
from nanoserve.course import workspace as course
from nanoserve.course.cli import main

LAST = checking.last_week()


@pytest.fixture(scope="module")
def solved(tmp_path_factory) -> Path:
    """A workspace with every week written (the reference's answers)."""
    ws = tmp_path_factory.mktemp("solved")
    course.make_workspace(LAST + 1, ws)
    return ws


def fake_runs(monkeypatch, failing: set[str] = frozenset(), calls: list | None = None) -> None:
    """Make every pytest run report each test of its targets as passed, but those named in
    `failing` (test function names) as failed; record the targets in `calls`."""
    def run_tests(targets, workspace, extra=None, echo=None):
        if calls is not None:
            calls.append(targets)
        run = checking.PytestRun(0, "")
        weeks = {int(t[len("tests/week"):][:2]) for t in targets}
        for t in exercise_map.marked_tests():
            if t.week in weeks:
                node = t.nodeid if "::" in t.nodeid else f"{t.nodeid}::test_in_a_marked_module"
                fails = node.split("::")[-1] in failing
                run.outcomes[node] = "FAILED" if fails else "PASSED"
                run.messages[node] = "AssertionError: made up" if fails else ""
                run.returncode = run.returncode or int(fails)
        run.output = f"{len(run.outcomes)} passed in 0.1s"
        return run
    monkeypatch.setattr(checking, "run_tests", run_tests)


def test_check_reports_in_the_lessons_order_and_marks_done_only_what_passes(tmp_path, monkeypatch, capsys):
    ws = tmp_path / "ws"
    course.make_workspace(5, ws)  # week 4 written
    course.reset_exercises({"week04:gather-kv"}, ws)  # ... but one stub, last in the lesson
    # `allocate` is written but wrong: its own test fails. It comes first in week 4's lesson,
    # though its file comes after the stub's (attention/paged.py sorts before scheduler/blocks.py).
    fake_runs(monkeypatch, failing={"test_out_of_blocks_is_clear"})
    assert main(["--workspace", str(ws), "check", "--week", "4"]) == 1
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  [")]
    assert lines == ["[ ] allocate   (written; 1 of its tests fail, first test_out_of_blocks_is_clear)",
                     "[x] free", "[x] slot-of", "[x] write-kv", "[ ] gather-kv   (still a stub)"]
    assert exercise_map.lesson_order(4, [n for n, _ in course.exercise_status(4, ws)]) == \
        ["allocate", "free", "slot-of", "write-kv", "gather-kv"]
    assert ("First failure: exercise 'allocate' of week 4: tests/week04/test_paged_cache.py::"
            "test_out_of_blocks_is_clear failed: AssertionError: made up") in out
    assert f"`{checking.course_command('check --exercise allocate')}`" in out
    # The stub is named once the written exercises pass.
    fake_runs(monkeypatch)
    assert main(["--workspace", str(ws), "check", "--week", "4"]) == 1
    assert "First failure: exercise 'gather-kv' of week 4 is still a stub" in capsys.readouterr().out


def test_a_failed_test_shared_by_two_exercises_says_so(solved, monkeypatch, capsys):
    fake_runs(monkeypatch, failing={"test_double_free_and_bad_pool"})  # checks allocate and free
    assert main(["--workspace", str(solved), "check", "--week", "4"]) == 1
    out = capsys.readouterr().out
    assert "[ ] allocate   (written; 1 of its tests fail, first test_double_free_and_bad_pool, which also " \
           "checks 'free')" in out
    assert "test_double_free_and_bad_pool failed, which also checks 'free'" in out


def test_a_passing_week_names_the_next_one_and_the_last_the_capstone(solved, monkeypatch, capsys):
    fake_runs(monkeypatch)
    assert main(["--workspace", str(solved), "check", "--week", "4"]) == 0
    assert f"Next: `{checking.course_command('start --week 5')}`, then read weeks/week05/README.md." in \
        capsys.readouterr().out
    assert main(["--workspace", str(solved), "check", "--week", str(checking.CORE_WEEKS)]) == 0
    out = capsys.readouterr().out
    assert "the capstone (weeks/capstone/README.md) is open to you" in out and f"--week {checking.CORE_WEEKS + 1}" in out
    assert main(["--workspace", str(solved), "check", "--week", str(LAST)]) == 0
    out = capsys.readouterr().out
    assert "That was the last week of the course. Next: the capstone, weeks/capstone/README.md" in out
    assert f"week {LAST + 1}" not in out and f"week{LAST + 1}" not in out
    assert main(["--workspace", str(solved), "check", "--week", str(LAST + 1)]) == 2
    assert f"there is no week {LAST + 1}: the weeks are 1 to {LAST}, then the capstone" in capsys.readouterr().err


def test_check_with_no_week_says_what_it_runs_before_running(tmp_path, monkeypatch, capsys):
    ws = tmp_path / "ws"
    course.make_workspace(3, ws)  # weeks 1 and 2 written, 3 on not started
    calls, said_first = [], []
    fake_runs(monkeypatch, calls=calls)
    fake = checking.run_tests

    def run_tests(*args, **kwargs):
        if not calls:  # what was printed before the first run
            said_first.append(capsys.readouterr().out)
        return fake(*args, **kwargs)
    monkeypatch.setattr(checking, "run_tests", run_tests)
    assert main(["--workspace", str(ws), "check"]) == 1
    assert f"about {checking.ALL_WEEKS_MINUTES} minutes" in said_first[0] and "weeks 1 to" in said_first[0]
    assert calls == [["tests/week01"], ["tests/week02"]]  # the weeks not started are not run
    out = capsys.readouterr().out
    assert re.search(r"^ +3 +0/7 +not started$", out, re.MULTILINE)
    assert f"The first week to finish is week 3: `{checking.course_command('check --week 3')}`" in out


def test_check_exercise_runs_that_exercises_own_fast_tests(solved, monkeypatch, capsys):
    calls = []
    fake_runs(monkeypatch, calls=calls)
    assert main(["--workspace", str(solved), "check", "--exercise", "slot-of"]) == 0
    assert calls == [[t.nodeid for t in exercise_map.tests_of(4, "slot-of") if t.fast]]
    out = capsys.readouterr().out
    assert "[x] slot-of" in out and "Next: exercise 'write-kv'." in out
    assert main(["--workspace", str(solved), "check", "--exercise", "nope"]) == 2
    assert "no exercise named 'nope'" in capsys.readouterr().err
    assert main(["--workspace", str(solved), "check", "--exercise", "rmsnorm", "--week", "2"]) == 2
    assert "'rmsnorm' is not an exercise of week 2: it is week01:rmsnorm" in capsys.readouterr().err


def test_hints_print_the_command_that_works_from_here(tmp_path, monkeypatch):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "nanoserve").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checking.shutil, "which", lambda tool: str(venv_bin / tool))  # an activated venv
    assert checking.course_command("check --week 3") == "nanoserve course check --week 3"
    monkeypatch.setattr(checking.shutil, "which", lambda tool: None)  # not activated: the path to it
    assert checking.course_command("check --week 3") == "venv/bin/nanoserve course check --week 3"
    assert checking.command("pytest") == "venv/bin/python -m pytest"  # no pytest script there
    monkeypatch.chdir(tmp_path / "venv")
    assert checking.command("nanoserve") == "bin/nanoserve"


def test_reset_asks_before_discarding_written_code(tmp_path, monkeypatch, capsys):
    ws = tmp_path / "ws"
    course.make_workspace(4, ws)  # week 3 written
    sampler = ws / "nanoserve" / "sampling" / "sampler.py"
    before = sampler.read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # a pipe: nobody to ask
    assert main(["--workspace", str(ws), "reset", "--week", "3"]) == 2
    assert "there is no terminal to ask on: add --yes" in capsys.readouterr().err
    assert sampler.read_text() == before

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stdin", Terminal())
    answers, prompts = iter(["n", "y"]), []
    monkeypatch.setattr("builtins.input", lambda prompt: (prompts.append(prompt), next(answers))[1])
    assert main(["--workspace", str(ws), "reset", "--week", "3"]) == 1
    assert prompts[0].startswith("Discard your code of 7 exercise(s) of week 3 (") and prompts[0].endswith("[y/N] ")
    assert "nothing reset" in capsys.readouterr().out
    assert sampler.read_text() == before
    assert main(["--workspace", str(ws), "reset", "--exercise", "sample"]) == 0
    assert "restored 1 stub(s) of exercise 'sample'" in capsys.readouterr().out
    assert "week 03 exercise 'sample'" in sampler.read_text() and "week 03 exercise 'top-k-top-p'" not in sampler.read_text()
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["--workspace", str(ws), "reset", "--week", "3", "--yes"]) == 0
    assert "restored 7 stub(s) of week 3" in capsys.readouterr().out
    assert main(["--workspace", str(ws), "reset", "--week", "3"]) == 0  # only stubs: nothing to ask about


# ------------------------------------------------------------------------ the real thing, twice


def test_check_runs_the_weeks_tests_and_names_the_first_stub(tmp_path, capsys):
    ws = tmp_path / "ws"
    course.make_workspace(4, ws)
    assert main(["--workspace", str(ws), "check", "--week", "4"]) == 1
    out = capsys.readouterr().out
    assert "[ ] allocate   (still a stub)" in out
    assert "First failure: exercise 'allocate' of week 4 is still a stub" in out
    assert "python -m nanoserve.course" not in out


def test_check_exercise_runs_for_real(solved, capsys):
    assert main(["--workspace", str(solved), "check", "--exercise", "week04:slot-of"]) == 0
    out = capsys.readouterr().out
    assert "Tests: 1 passed" in out and "[x] slot-of" in out


def test_a_run_that_hangs_is_stopped_and_says_so(tmp_path):
    """`run_tests` kills a pytest run still going after its limit, and its output says which run and
    how long; the returned code is not 0, so `check` reports it as not passing."""
    hangs = tmp_path / "test_hangs.py"
    hangs.write_text("import time\n\n\ndef test_sleeps():\n    time.sleep(60)\n")
    run = checking.run_tests([str(hangs)], None, limit_s=8)
    assert run.returncode != 0
    assert "ran past 8 s and was stopped" in run.output and str(hangs) in run.output
    assert "no tests ran" in run.summary or "passed" not in run.summary


def test_an_interrupted_run_leaves_no_pytest_behind(tmp_path, monkeypatch):
    """If the caller stops reading (here: `echo` raises, as Ctrl-C would), the pytest child is killed."""
    import subprocess as sp

    hangs = tmp_path / "test_hangs_too.py"
    hangs.write_text("import time\n\n\ndef test_a():\n    pass\n\n\ndef test_sleeps():\n    time.sleep(60)\n")
    started = []
    real_popen = sp.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def echo(ch):
        raise KeyboardInterrupt

    monkeypatch.setattr(checking.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        checking.run_tests([str(hangs)], None, echo=echo, limit_s=60)
    assert started and started[0].wait(timeout=10) != 0
