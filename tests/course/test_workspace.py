"""The course mechanics: markers, the generated workspace, and tests of the tests.

For every week N that has exercises and tests: the week's tests must FAIL on a workspace
stubbed from week N (a week whose tests pass on its own stubs checks nothing), and must PASS
on a workspace stubbed from week N + 1 (they need nothing from later weeks). Stubbing only ever
removes code, so passing with weeks N+1.. stubbed implies passing with any later start week.
"""

import ast
from pathlib import Path

import pytest

from nanoserve import course

REPO = Path(course.REPO_DIR)
TEST_WEEKS = sorted(int(p.name[4:]) for p in (REPO / "tests").glob("week[0-9][0-9]") if p.is_dir())
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
    assert course.main(["--workspace", str(ws), "start", "--week", "3"]) == 0
    sampling = ws / "nanoserve" / "sampling.py"
    text = sampling.read_text()
    assert "week 03 exercise 'sample'" in text
    assert "week 02 exercise" not in (ws / "nanoserve" / "layers.py").read_text()  # earlier weeks solved
    # The learner solves one exercise; re-running start keeps it.
    solution = course.peek("sample")
    assert "exponential" in solution and solution.startswith("--- week03:sample")
    solved = text.replace(
        "    raise NotImplementedError(\"week 03 exercise 'top-k-top-p': see weeks/week03/README.md\")\n",
        "    return logits  # my attempt\n")
    sampling.write_text(solved)
    course.make_workspace(2, ws)
    assert "return logits  # my attempt" in sampling.read_text()
    assert "week 02 exercise 'attention'" in (ws / "nanoserve" / "layers.py").read_text()
    assert course.reset_week(3, ws) == 7
    assert "my attempt" not in sampling.read_text()
    assert course.main(["peek", "nope"]) == 2
    assert "no exercise named 'nope'" in capsys.readouterr().err


def test_check_reports_the_first_stub(tmp_path, capsys):
    ws = tmp_path / "ws"
    course.make_workspace(4, ws)
    assert course.main(["--workspace", str(ws), "check", "--week", "4"]) == 1
    out = capsys.readouterr().out
    assert "[ ] allocate   (still a stub)" in out
    assert "First failure: exercise '" in out and "of week 4 is still a stub" in out
    assert "weeks/week04/README.md" in out


@pytest.mark.parametrize("week", [w for w in TEST_WEEKS if w in EXERCISE_WEEKS])
def test_week_tests_catch_their_own_stubs(week, tmp_path):
    ws_own = tmp_path / "own"
    course.make_workspace(week, ws_own, keep_learner_work=False)
    failing = course.run_week_tests(week, ws_own, extra=["-x"])
    assert failing.returncode in (1, 2), (
        f"tests/week{week:02d} pass on a workspace where week {week} is only stubs: they check nothing\n"
        + failing.stdout[-2000:])
    # (Server tests see a stub only as a dropped connection, so the output need not name it.)
    if any(w > week for w in EXERCISE_WEEKS):
        ws_next = tmp_path / "next"
        course.make_workspace(week + 1, ws_next, keep_learner_work=False)
        passing = course.run_week_tests(week, ws_next)
        assert passing.returncode == 0, (
            f"tests/week{week:02d} need code from a later week:\n" + passing.stdout[-3000:])
