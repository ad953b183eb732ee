"""The course mechanics: markers, the generated workspace, and tests of the tests.

For every week N that has exercises and tests: the week's tests must FAIL on a workspace
stubbed from week N (a week whose tests pass on its own stubs checks nothing), and must PASS
on a workspace stubbed from week N + 1 (they need nothing from later weeks). Stubbing only ever
removes code, so passing with weeks N+1.. stubbed implies passing with any later start week.
Both checks share one workspace and one inner pytest run: on the one stubbed from week N,
tests/week(N-1) must pass, then tests/weekNN must fail.

The budget. This file is the slowest of the suite: it runs every week's fast tests once more,
each on its own generated workspace, in a fresh interpreter. Measured with `--durations=0` on a
2-core machine busy with other work (load average 7 to 11): 30 minutes in all (55 before the
weekly test ran only the tests marked with the week's exercises against its stubs), the 18
weekly tests from 14 s (week 1) to 5 minutes (week 13, which runs week 12's tests in full), the
rest of the file under 30 s. A quiet machine takes a fraction of that. Nothing here enforces a
time: a busy machine is slower, never wrong. So that the suite never looks stuck, each weekly
test prints to the terminal, whatever `-s` says, which workspace it builds and which tests must
fail or pass, then the inner run's progress dots as they come (`say` below). tests/conftest.py
runs this file last, after the tests it checks.
"""

import ast
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoserve.course import check as checking
from nanoserve.course import exercise_map
from nanoserve.course import workspace as course
from nanoserve.course.cli import main

REPO = Path(course.REPO_DIR)
# The weeks whose lesson is written. A week's tests may land before its lesson and exercises do (issue 35's
# tests/week21, before weeks/week21): they are checked as any test, not yet as a week of the course.
TEST_WEEKS = sorted(int(p.name[4:]) for p in (REPO / "tests").glob("week[0-9][0-9]")
                    if p.is_dir() and (REPO / "weeks" / p.name / "README.md").is_file())
EXERCISE_WEEKS = course.weeks_with_exercises()


def test_markers_are_well_formed_and_every_week_has_exercises():
    exercises = course.all_exercises()  # raises MarkerError on any malformed pair
    assert len(exercises) >= len(TEST_WEEKS)
    for week in range(1, max(TEST_WEEKS) + 1):
        assert week in EXERCISE_WEEKS, f"week {week} has no exercise"
    for week in TEST_WEEKS:
        assert week in EXERCISE_WEEKS, f"tests/week{week:02d} exists but week {week} has no exercise"


@pytest.mark.parametrize("bad,message", [
    ("    # >>> week01: a\n    x = 1\n", "never closed"),
    ("    # >>> week01: a\n    x = 1\n    # <<< week02: a\n", "does not match"),
    ("    # <<< week01: a\n", "without an opening"),
    ("# >>> week01: a\nx = 1\n# <<< week01: a\n", "inside a function"),
    ("    # >>> week1: a\n", "malformed"),
    ("    # >>> week01: a\n    # <<< week01: a\n", "empty"),
])
def test_malformed_markers_are_caught(bad, message):
    with pytest.raises(course.MarkerError, match=message):
        course.find_exercises(bad.splitlines(keepends=True), Path("x.py"))


def signatures(path: Path) -> dict[str, str]:
    """Public functions, classes and methods of a module with their argument lists."""
    out = {}

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + child.name] = ast.unparse(child.args) + " -> " + (ast.unparse(child.returns) if child.returns else "")
            elif isinstance(child, ast.ClassDef):
                out[prefix + child.name] = "class"
                visit(child, prefix + child.name + ".")
    visit(ast.parse(path.read_text()))
    return out


def test_stubbed_modules_keep_every_name_and_signature(tmp_path):
    target = course.make_workspace(1, tmp_path / "ws")  # every exercise stubbed
    for rel in course.source_files():
        assert signatures(course.PACKAGE_DIR / rel) == signatures(target / rel), rel
        stubbed = (target / rel).read_text()
        compile(stubbed, str(rel), "exec")  # still valid Python
    stubbed = course.all_exercises(target)
    assert len(stubbed) == len(course.all_exercises())
    assert all(course.is_stub(e.body((target / e.path).read_text().splitlines(keepends=True))) for e in stubbed)


def test_start_peek_reset_and_learner_work_survives(tmp_path, capsys):
    ws = tmp_path / "ws"
    assert main(["--workspace", str(ws), "start", "--week", "3"]) == 0
    sampling = ws / "nanoserve" / "sampling" / "sampler.py"
    text = sampling.read_text()
    assert "week 03 exercise 'sample'" in text
    assert "week 02 exercise" not in (ws / "nanoserve" / "model" / "layers.py").read_text()  # earlier weeks solved
    # The learner solves one exercise; re-running start keeps it.
    solution = course.peek("sample")
    assert "exponential" in solution and solution.startswith("--- week03:sample")
    solved = text.replace(
        "    raise NotImplementedError(\"week 03 exercise 'top-k-top-p': see weeks/week03/README.md\")\n",
        "    return logits  # my attempt\n")
    sampling.write_text(solved)
    course.make_workspace(2, ws)
    assert "return logits  # my attempt" in sampling.read_text()
    assert "week 02 exercise 'attention'" in (ws / "nanoserve" / "model" / "layers.py").read_text()
    assert course.reset_exercises(course.week_keys(3), ws) == 7
    assert "my attempt" not in sampling.read_text()
    assert main(["peek", "nope"]) == 2
    assert "no exercise named 'nope'" in capsys.readouterr().err


def test_answers_follow_their_exercise_when_the_layout_changes(tmp_path, capsys):
    """A workspace made from another layout of the reference (modules since moved, split or
    renamed, exercises re-indented) keeps every answer: `start` carries them by exercise key."""
    ws = tmp_path / "ws"
    target = course.make_workspace(1, ws)
    # The learner solves all of week 1 and one exercise of week 2, each in their own words.
    mine = {}
    for ex in course.all_exercises(target):
        if ex.week == 1 or ex.key == "week02:attention":
            answer = course.peek(ex.key).splitlines(keepends=True)[1:]
            mine[ex.key] = [f"# my answer to {ex.key}\n"] + answer
    for rel in course.source_files():
        lines = (target / rel).read_text().splitlines(keepends=True)
        for ex in reversed(course.find_exercises(lines, rel)):
            if ex.key in mine:
                lines[ex.begin + 1 : ex.end] = course.indent_to(mine[ex.key], ex.indent)
        (target / rel).write_text("".join(lines))
    # Now pretend it came from an older layout: every module somewhere else, some with their
    # exercises one level deeper (a function that was later moved out of a class, say).
    old = {}
    for rel in course.source_files():
        text = (target / rel).read_text()
        if rel.name == "layers.py":
            text = "".join("    " + line if line.strip() and line.startswith("    ") else line
                           for line in text.splitlines(keepends=True))
        old_rel = Path("old_layout") / ("_".join(rel.parts))
        (target / old_rel).parent.mkdir(parents=True, exist_ok=True)
        (target / old_rel).write_text(text)
        (target / rel).unlink()
        old[rel] = old_rel
    assert course.make_workspace(3, ws) == target
    assert "module(s) the reference no longer has" in capsys.readouterr().out
    assert not (target / "old_layout").exists()
    assert (ws / "replaced" / "old_layout").is_dir()  # moved out of the package, not deleted
    for ex in course.all_exercises(target):
        body = course.dedent(ex.body((target / ex.path).read_text().splitlines(keepends=True)), ex.indent)
        if ex.key in mine:
            assert body == mine[ex.key], ex.key
        elif ex.week >= 3:
            assert course.is_stub(body), ex.key
        else:  # week 2's other exercises: solved from the reference, as `start --week 3` does
            assert body == course.peek(ex.key).splitlines(keepends=True)[1:], ex.key
    # ... and the carried answers still pass their week's tests.
    result = checking.run_week_tests(1, ws, extra=unused_plugins(["tests/week01"]))
    assert result.returncode == 0, result.output[-3000:]


ISOLATED_RUN = """
import sys
from pathlib import Path

# No editable install, no repository on the path: only the workspace (and torch & co.).
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
sys.path.insert(0, sys.argv[1])
import nanoserve
from nanoserve.course.stubs import stubbed_weeks
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.sampling.params import SamplingParams

assert Path(nanoserve.__file__).is_relative_to(sys.argv[1]), nanoserve.__file__
engine = Engine(EngineConfig(max_model_len=64))
engine.add_request("Hello", SamplingParams(max_tokens=3, temperature=0))
while engine.has_unfinished():
    engine.step()
print(sorted(stubbed_weeks()), engine.scheduler.prefix_caching)
"""


def test_the_workspace_engine_runs_without_the_reference_installed(tmp_path):
    """The workspace's engine asks which weeks are still stubs (prefix caching stays off until
    week 14 is written) through its own copy of nanoserve/course/stubs.py, not through the
    reference's installation."""
    ws = tmp_path / "ws"
    course.make_workspace(9, ws, keep_learner_work=False)  # the engine's continuous batching is week 8's
    assert not (ws / "nanoserve" / "course" / "workspace.py").exists()  # only the stub finder is copied
    result = subprocess.run([sys.executable, "-c", ISOLATED_RUN, str(ws)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    weeks, prefix_caching = result.stdout.strip().rsplit(" ", 1)
    assert weeks == str(list(range(9, max(EXERCISE_WEEKS) + 1))) and prefix_caching == "False"


@pytest.fixture
def say(request):
    """Print a line to the terminal now, past pytest's capture (`-s` or not): a weekly test runs
    for minutes, and a suite that prints nothing for that long looks stuck. `say(text, end="")`
    continues the line (the inner run's progress dots)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(text: str, end: str = "\n") -> None:
        if reporter is None or capture is None:
            return
        with capture.global_and_fixture_disabled():
            reporter.write(text + end, flush=True)
    return say


WEEKS = [w for w in TEST_WEEKS if w in EXERCISE_WEEKS]

# Pytest plugins installed with the dev extras, which every pytest process loads through their entry
# points, and the word a test must contain to use one: a plugin only adds fixtures, markers and options,
# which a test names. Loading them is a good part of an inner run's start-up: on the 2-core machine
# `pytest --collect-only tests/week07` took 5.9 s with them, 3.9 s without schemathesis and anyio
# (schemathesis imports hypothesis, graphql, requests, ...) and 3.2 s without hypothesis's as well, and
# this file starts an inner run a week. Each inner run leaves out those that no file of its tests'
# folders names (`-p no:NAME`): tests/week10/test_fuzz.py still gets schemathesis, and the weeks with
# property-based tests hypothesis's plugin.
PLUGINS = {"schemathesis": "schemathesis", "hypothesispytest": "hypothesis", "anyio": "anyio"}


def unused_plugins(targets: list[str]) -> list[str]:
    """`-p no:NAME` for each plugin of PLUGINS that no Python file of the targets' folders (and no conftest.py
    above them) names."""
    folders = {(REPO / target.split("::")[0]) for target in targets}
    folders = {f if f.is_dir() else f.parent for f in folders}
    files = {path for folder in folders for path in folder.rglob("*.py")}
    files |= {c for folder in folders for c in (folder / "conftest.py", *(p / "conftest.py" for p in folder.parents))
              if c.is_file()}
    text = "".join(path.read_text() for path in sorted(files))
    return [opt for name, word in PLUGINS.items() if word not in text for opt in ("-p", f"no:{name}")]


# One inner run a week: a second pytest process would pay the start-up again (the interpreter, torch, the
# conftests: 4 to 7 s on the 2-core machine, two thirds of a run of week 7's marked tests). The earlier week's
# tests run first, then the week's own, with -x for these alone: this plugin, which the inner run loads
# with `-p` from a folder put on its PYTHONPATH. pytest's own -x would also count a module of the week that
# fails to import (week 3's test_sampling.py builds SamplingParams, a stub, as it is imported), and stop at
# collection, before the earlier week's tests ran; and so would naming the marked tests by node id (a node
# id in a module that did not import is a usage error): the run is given their files, the plugin keeps
# the marked tests of them.
STOP_AT_THE_WEEKS_FIRST_FAILURE = """
import json

import pytest

FOLDER = {folder!r}  # the week's tests: run last, and the first of them to fail (or not import) ends the run
MARKED = {marked!r}  # the ones of its tests to run (the run is given their files)
state = dict(session=None, not_imported=None, earlier=[], finished=set())


def pytest_sessionstart(session):
    state["session"] = session


def marked(nodeid):  # as pytest selects by node id: a test with its parametrizations, a class, a module
    return any(nodeid == m or nodeid.startswith((m + "::", m + "[")) for m in MARKED)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid.startswith(FOLDER) and not marked(i.nodeid)])
    items[:] = [i for i in items if not i.nodeid.startswith(FOLDER) or marked(i.nodeid)]
    items.sort(key=lambda item: item.nodeid.startswith(FOLDER))  # stable: the earlier week's in their order
    state["earlier"] = [item.nodeid for item in items if not item.nodeid.startswith(FOLDER)]


def pytest_collectreport(report):
    if report.failed and report.nodeid.startswith(FOLDER) and state["not_imported"] is None:
        state["not_imported"] = report.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.nodeid.startswith(FOLDER) and state["not_imported"] is not None:
        item.session.shouldfail = "stopping: " + state["not_imported"] + " failed to import"
        return True  # run no test of the week: one of its modules failed already


def pytest_runtest_logreport(report):
    if report.failed and report.nodeid.startswith(FOLDER):
        state["session"].shouldfail = "stopping after the first failure in " + FOLDER
    if report.when == "teardown":
        state["finished"].add(report.nodeid)


def pytest_sessionfinish(session):  # did every test of the earlier week run to its end? (pytest.exit would stop them)
    unfinished = [n for n in state["earlier"] if n not in state["finished"]]
    with open({tally!r}, "w") as f:
        json.dump(dict(earlier=len(state["earlier"]), unfinished=unfinished), f)
"""


# Under pytest-xdist, on either worker: an inner run peaks under 1 GB. (They once ran on the worker of the
# large models, one after another, when an inner run held up to 14 GB: week 12's `bench all --quick`, whose
# HuggingFace side sized its KV pool from the machine's RAM, now capped to the workload in
# bench/throughput.py. On both workers the suite ends sooner: these are its largest tests.) The latest week
# first: the first weeks' runs are the shortest (10 to 15 s on the 2-core machine, against 20 to 80 from
# week 7 on), and short tests last keep one worker from finishing long before the other.
@pytest.mark.parametrize("week", sorted(WEEKS, reverse=True))
def test_week_tests_catch_their_own_stubs(week, tmp_path, say, monkeypatch):
    """On a workspace stubbed from week N: the tests of the week before pass (they need nothing from
    week N on), and week N's tests fail (else they check nothing). Of week N's tests, those marked with
    its exercises run (`exercise_map`), after the earlier week's, in the same run, with -x for them
    alone (STOP_AT_THE_WEEKS_FIRST_FAILURE): a stub fails them at once, where a test that no stub
    reaches could run for minutes first. The earlier week's tests run first because they are the ones
    known to leave nothing behind (the outer run runs every test in one process), where a week's test
    that a stub stopped halfway may."""
    started = time.perf_counter()
    ws = tmp_path / "ws"
    course.make_workspace(week, ws, keep_learner_work=False)
    before = [w for w in WEEKS if w < week][-1:]
    mine = [t.nodeid for t in exercise_map.marked_tests() if t.week == week and t.fast]
    targets = [f"tests/week{w:02d}" for w in before] + sorted({node.split("::")[0] for node in mine})
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    folder = f"tests/week{week:02d}/"
    tally = tmp_path / "tally.json"
    (plugin / "stop_at_the_weeks_first_failure.py").write_text(
        STOP_AT_THE_WEEKS_FIRST_FAILURE.format(folder=folder, marked=mine, tally=str(tally)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(plugin), os.environ.get("PYTHONPATH")] if p))

    def echo(progress: str) -> None:  # the inner run's dots, as they come
        say(progress, end="")
    say(f"\n  [course] week {week}, on a workspace stubbed from week {week}: "
        + "".join(f"tests/week{w:02d} must pass, then " for w in before) + f"tests/week{week:02d} must fail: ", end="")
    run = checking.run_tests(targets, ws, extra=["-p", "stop_at_the_weeks_first_failure", *unused_plugins(targets)],
                             echo=echo)
    summary = run.output[run.output.rfind("short test summary info"):]  # not the tests' own output
    verdicts = [(m[1], m[2]) for m in map(checking.SUMMARY.match, summary.splitlines()) if m]
    # (Server tests see a stub only as a dropped connection, so the output need not name it.)
    assert run.returncode != 0 and any(v != "PASSED" for v, node in verdicts if node.startswith(folder)), (
        f"tests/week{week:02d} pass on a workspace where week {week} is only stubs: they check nothing\n"
        + run.output[-2000:])
    for w in before:
        theirs = [(v, node) for v, node in verdicts if node.startswith(f"tests/week{w:02d}/")]
        assert theirs and all(v == "PASSED" for v, _ in theirs), (
            f"tests/week{w:02d} need code from week {week}:\n" + run.output[-3000:])
        ran = json.loads(tally.read_text())
        assert ran["earlier"] and not ran["unfinished"], (
            f"tests/week{w:02d} did not all run: {ran}\n" + run.output[-3000:])
    say(f"  ({time.perf_counter() - started:.0f} s)")


# ------------------------------------------------------------------- notebooks on the workspace

NOTEBOOKS = sorted((REPO / "notebooks").glob("week[0-9][0-9]_*.ipynb"))


def first_code_cell(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def test_every_notebook_starts_with_the_same_workspace_cell():
    reference = first_code_cell(NOTEBOOKS[0])
    assert course.ENV_VAR in reference
    differ = [p.name for p in NOTEBOOKS if first_code_cell(p) != reference]
    assert not differ, f"these notebooks do not start with the cell of {NOTEBOOKS[0].name}: {differ}"


@pytest.fixture(scope="module")
def stubbed_workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("notebook-ws")
    course.make_workspace(1, ws, keep_learner_work=False)
    return ws


def run_first_cell(path: Path, workspace: str | None) -> subprocess.CompletedProcess:
    """A notebook's first code cell alone, in a fresh interpreter started in notebooks/, as a kernel is."""
    env = {k: v for k, v in os.environ.items() if k != course.ENV_VAR}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)  # as test_notebooks.py
    if workspace is not None:
        env[course.ENV_VAR] = workspace
    code = first_code_cell(path) + "\nprint('FILE=' + nanoserve.__file__)\n"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO / "notebooks", env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_a_notebooks_first_cell_imports_the_workspace(path, stubbed_workspace):
    mine = run_first_cell(path, str(stubbed_workspace))
    assert mine.returncode == 0, mine.stderr
    imported = Path(mine.stdout.split("FILE=")[-1].strip())
    assert imported.resolve() == (stubbed_workspace / "nanoserve" / "__init__.py").resolve()
    assert "your workspace" in mine.stdout
    reference = run_first_cell(path, None)
    assert reference.returncode == 0, reference.stderr
    assert Path(reference.stdout.split("FILE=")[-1].strip()).resolve() == course.PACKAGE_DIR / "__init__.py"
    assert "the reference" in reference.stdout
    # A variable that names no workspace (a relative path counts from notebooks/) is an error,
    # not a silent fall back to the reference.
    wrong = run_first_cell(path, "workspace")
    assert wrong.returncode != 0 and "ImportError" in wrong.stderr


def test_notebook_command_opens_the_weeks_notebook_on_the_workspace(tmp_path, capsys, monkeypatch):
    ws = tmp_path / "ws"
    assert main(["--workspace", str(ws), "notebook", "--week", "5", "--dry-run"]) == 2
    assert f"no workspace at {ws}: run `nanoserve course start --week 5` first" in capsys.readouterr().err
    course.make_workspace(5, ws)

    cmd, env = course.notebook_command(5, ws, no_browser=True)
    assert cmd == [sys.executable, "-m", "jupyterlab", "notebooks/week05_engine.ipynb", "--no-browser"]
    assert env == {course.ENV_VAR: str(ws.resolve())}
    # --dry-run prints the command and its environment, and starts nothing; other options go to Jupyter.
    assert main(["--workspace", str(ws), "notebook", "--week", "5", "--no-browser", "--dry-run",
                        "--port", "8899"]) == 0
    expected = [sys.executable, "-m", "jupyterlab", "notebooks/week05_engine.ipynb", "--no-browser", "--port", "8899"]
    assert f"{course.ENV_VAR}={shlex.quote(str(ws.resolve()))} {shlex.join(expected)}" in capsys.readouterr().out
    assert main(["notebook", "--week", "5", "--workspace", str(ws), "--dry-run"]) == 0  # either place
    assert f"{course.ENV_VAR}={shlex.quote(str(ws.resolve()))} " in capsys.readouterr().out
    assert main(["--workspace", str(ws), "notebook", "--week", "99", "--dry-run"]) == 2
    assert "week 99 has no notebook" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # only `notebook` passes options on
        main(["peek", "rmsnorm", "--port", "8899"])
    assert "unrecognized arguments: --port 8899" in capsys.readouterr().err
    for path in NOTEBOOKS:
        assert path in course.week_notebooks(int(path.name[4:6]))

    # Without --dry-run: the same command, run in the repository root with the variable set.
    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("JupyterLab is not installed: pip install -e '.[dev]'")
    launched = {}

    class FakePopen:  # stands in for the Jupyter server
        def __init__(self, cmd, cwd, env):
            launched.update(cmd=cmd, cwd=cwd, env=env)

        def wait(self):
            return 0

    monkeypatch.setattr(course.subprocess, "Popen", FakePopen)
    assert main(["--workspace", str(ws), "notebook", "--week", "5"]) == 0
    assert launched["cmd"] == [sys.executable, "-m", "jupyterlab", "notebooks/week05_engine.ipynb"]
    assert launched["cwd"] == course.REPO_DIR
    assert launched["env"][course.ENV_VAR] == str(ws.resolve())
    assert launched["env"]["PATH"] == os.environ["PATH"]  # the rest of the environment is kept
    out = capsys.readouterr().out
    assert "Still stubs there, up to week 5: week05:" in out
