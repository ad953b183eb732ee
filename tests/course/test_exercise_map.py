"""Every exercise has tests of its own, and the lesson orders them (no workspace is built: fast).

`nanoserve course check` marks an exercise done when its own tests pass, and `check --exercise
NAME` runs them; both read the `pytest.mark.exercise(...)` markers of tests/weekNN/
(nanoserve/course/exercise_map.py). A marker with a typo, or an exercise that no fast test
names, would make those commands silently wrong: these tests make it loud.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from nanoserve.course import check as checking
from nanoserve.course import exercise_map
from nanoserve.course import workspace as course

EXERCISES = course.all_exercises()
MARKED = exercise_map.marked_tests()


@pytest.mark.parametrize("ex", EXERCISES, ids=[e.key for e in EXERCISES])
def test_every_exercise_has_a_fast_test_of_its_own(ex):
    mine = exercise_map.tests_of(ex.week, ex.name, MARKED)
    assert mine, (f"no test of tests/week{ex.week:02d} is marked @pytest.mark.exercise({ex.name!r}): mark the "
                  f"tests weeks/week{ex.week:02d}/README.md names for it (or write one)")
    assert any(t.fast for t in mine), (f"every test of exercise {ex.key} is marked slow or gpu: `course check` "
                                       "runs the fast tests only, so it could never mark it done")


def test_every_marker_names_an_exercise_of_its_week():
    known = {(e.week, e.name) for e in EXERCISES}
    wrong = [f"{t.nodeid}: {name!r}" for t in MARKED for name in t.exercises if (t.week, name) not in known]
    assert not wrong, "markers that name no exercise of their folder's week:\n" + "\n".join(wrong)


def test_every_marked_test_exists():
    """The scan reads the source, as pytest would collect it: every marked node is a real file,
    function or class (a marker always sits on the thing it names, so this guards the scan)."""
    for t in MARKED:
        path, *names = t.nodeid.split("::")
        text = (course.REPO_DIR / path).read_text()
        for name in names:
            assert f"def {name}(" in text or f"class {name}" in text, t.nodeid


def test_every_exercise_is_a_heading_of_its_lesson():
    """`course check` lists a week's exercises in the order of the lesson's `### \\`name\\``
    headings: each must have one."""
    for week in course.weeks_with_exercises():
        names = [e.name for e in EXERCISES if e.week == week]
        missing = set(names) - set(exercise_map.lesson_headings(week))
        assert not missing, f"weeks/week{week:02d}/README.md has no `### \\`name\\`` heading for {sorted(missing)}"


def test_the_scan_reads_functions_classes_and_modules(tmp_path):
    folder = tmp_path / "tests" / "week04"
    folder.mkdir(parents=True)
    (folder / "test_x.py").write_text(textwrap.dedent("""
        import pytest

        pytestmark = [pytest.mark.exercise("free"), pytest.mark.slow]

        @pytest.mark.exercise("allocate", "slot-of")
        @pytest.mark.parametrize("n", [1, 2])
        def test_a(n):
            pass

        @pytest.mark.exercise("gather-kv")
        class TestPool:
            @pytest.mark.exercise("write-kv")
            def test_b(self):
                pass

        def test_unmarked():
            pass
    """))
    found = {t.nodeid: (t.exercises, t.fast) for t in exercise_map.marked_tests(tmp_path / "tests")}
    assert found == {
        "tests/week04/test_x.py": (("free",), False),
        "tests/week04/test_x.py::test_a": (("allocate", "slot-of"), False),  # the module is slow
        "tests/week04/test_x.py::TestPool": (("gather-kv",), False),
        "tests/week04/test_x.py::TestPool::test_b": (("write-kv",), False),
    }
    test_a = exercise_map.MarkedTest("tests/week04/test_x.py::test_a", 4, ("allocate",), True)
    assert test_a.covers("tests/week04/test_x.py::test_a[1]")
    assert test_a.covers("tests/week04/test_x.py")  # the module failed to import: its tests fail
    assert not test_a.covers("tests/week04/test_x.py::test_ab")
    (folder / "test_y.py").write_text("import pytest\n\n@pytest.mark.exercise(NAME)\ndef test_c():\n    pass\n")
    with pytest.raises(ValueError, match="plain strings"):
        exercise_map.marked_tests(tmp_path / "tests")


def test_lesson_order_follows_the_headings(tmp_path):
    (tmp_path / "week04").mkdir()
    (tmp_path / "week04" / "README.md").write_text(
        "## Exercises\n\n### `slot-of` (blocks.py)\n\ntext `free`\n\n### `allocate`\n\n#### `free` is a subsection\n")
    assert exercise_map.lesson_order(4, ["allocate", "free", "slot-of"], tmp_path) == ["slot-of", "allocate", "free"]
    assert exercise_map.lesson_order(5, ["b", "a"], Path(tmp_path)) == ["b", "a"]  # no lesson: as given


# ------------------------------------------- each exercise's tests fail on its own stub (opt-in)

EACH = os.environ.get("NANOSERVE_CHECK_EACH_EXERCISE") == "1"


@pytest.fixture(scope="module")
def solved_workspace(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("solved")
    course.make_workspace(max(course.weeks_with_exercises()) + 1, ws, keep_learner_work=False)
    return ws


OFF = pytest.param(None, id="each", marks=pytest.mark.skip(
    reason="one pytest run per exercise, about half an hour on 2 cores: NANOSERVE_CHECK_EACH_EXERCISE=1 checks "
           "that the tests marked with each exercise fail on a workspace where it alone is a stub"))


@pytest.mark.parametrize("ex", [pytest.param(e, id=e.key) for e in EXERCISES] if EACH else [OFF])
def test_each_exercises_tests_fail_on_its_stub_alone(ex, solved_workspace):
    """The marker is true: on a workspace where every other exercise is solved, the fast tests
    marked with this exercise fail once it alone is a stub (so `course check` never marks a
    stub, or a wrong answer that breaks what they test, done)."""
    nodes = [t.nodeid for t in exercise_map.tests_of(ex.week, ex.name, MARKED) if t.fast]
    assert course.reset_exercises({ex.key}, solved_workspace) == 1
    try:
        run = checking.run_tests(nodes, solved_workspace, extra=["-x"])
    finally:
        course.make_workspace(max(course.weeks_with_exercises()) + 1, solved_workspace, keep_learner_work=False)
    # (A stub that runs at import, as a dataclass's __post_init__ in a module-level constant can,
    # fails the module's collection: pytest then exits with 4, "found no collectors".)
    failed = [node for node, outcome in run.outcomes.items() if outcome != "PASSED"]
    assert run.returncode != 0 and failed, f"the tests of {ex.key} pass with it stubbed: {nodes}\n{run.output[-2000:]}"


# -- exercises with substance: every bonus week has whole pieces to design, not only one-liners ---

FIRST_BONUS_WEEK = 13
LARGE = 15  # reference lines (code, not blank lines or comments) that make an exercise a whole piece
LARGE_PER_WEEK = 2


def reference_lines(ex: course.Exercise) -> int:
    body = ex.body((course.PACKAGE_DIR / ex.path).read_text(encoding="utf-8").splitlines())
    return sum(1 for line in body if line.strip() and not line.strip().startswith("#"))


def thin_weeks(sizes: dict[str, int]) -> dict[int, list[str]]:
    """Bonus weeks with fewer than LARGE_PER_WEEK exercises of LARGE lines, each with its sizes.
    `sizes` maps an exercise key ('week14:match-prefix') to its reference lines."""
    weeks: dict[int, list[tuple[str, int]]] = {}
    for key, n in sizes.items():
        weeks.setdefault(int(key[4:6]), []).append((key, n))
    return {week: [f"{k} {n}" for k, n in found] for week, found in weeks.items()
            if week >= FIRST_BONUS_WEEK and sum(n >= LARGE for _, n in found) < LARGE_PER_WEEK}


def test_every_bonus_week_has_two_whole_pieces_to_design():
    thin = thin_weeks({ex.key: reference_lines(ex) for ex in EXERCISES})
    assert not thin, f"weeks with fewer than {LARGE_PER_WEEK} exercises of {LARGE}+ lines: {thin}"


def test_a_planted_thin_week_is_caught():
    sizes = {ex.key: reference_lines(ex) for ex in EXERCISES}
    week14 = sorted((k for k in sizes if k.startswith("week14:")), key=sizes.get)
    sizes[week14[-1]] = 3  # the largest of week 14 cut to a one-liner: one whole piece left
    assert list(thin_weeks(sizes)) == [14]
    sizes.update({"week99:a": 40, "week99:b": 14})  # a new week with one whole piece
    assert set(thin_weeks(sizes)) == {14, 99}
    assert thin_weeks({"week03:tiny": 1}) == {}  # the first twelve weeks are exempt
