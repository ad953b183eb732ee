"""Which tests check which exercise, and in which order a lesson teaches its exercises.

A test names the exercises it checks with a marker, on the test function, on its class, or on
the whole module (`pytestmark = pytest.mark.exercise(...)`):

    @pytest.mark.exercise("rmsnorm")
    def test_rmsnorm_matches_hf(...):

The marker sits beside the test, so whoever writes or renames a test sees which exercise it
proves; `nanoserve course check --exercise rmsnorm` runs exactly those tests, and `course check`
marks an exercise done only when they pass. The markers are read from the source (`ast`, not
pytest's collection), so the map is known in a fraction of a second, without importing a test.
The names are those of week NN's exercises, for the tests in tests/weekNN/; a test of the course
(tests/course/test_exercise_map.py) checks that every exercise has at least one fast test and
that every marker names an exercise that exists.

The lesson's order: the `### \\`name\\`` headings of weeks/weekNN/README.md, which is where each
exercise is specified, in the order the lesson suggests doing them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from nanoserve.course.stubs import PACKAGE_DIR

REPO_DIR = PACKAGE_DIR.parent
TESTS_DIR = REPO_DIR / "tests"
LESSONS_DIR = REPO_DIR / "weeks"
HEADING = re.compile(r"^###\s+`(?P<name>[a-z0-9-]+)`", re.MULTILINE)


@dataclass(frozen=True)
class MarkedTest:
    """One marked node: a test function, a test class or a whole module, as pytest names it."""

    nodeid: str  # 'tests/week04/test_paged_cache.py::test_slot_arithmetic' (or a module's path)
    week: int  # the NN of the tests/weekNN/ it lives in
    exercises: tuple[str, ...]
    fast: bool  # not marked slow or gpu (where a marker says so: function, class or module)

    def covers(self, nodeid: str) -> bool:
        """Whether a reported node id (a test, a parametrized case, or a module that failed to
        import) belongs to this marked node."""
        nodeid = nodeid.split("[", 1)[0]
        return nodeid == self.nodeid or nodeid.startswith(self.nodeid + "::") or \
            self.nodeid.startswith(nodeid + "::")


def _mark_names(node: ast.expr, mark: str) -> list[ast.Call | ast.Attribute]:
    """The `pytest.mark.<mark>` uses in a decorator or a `pytestmark` value (a mark or a list)."""
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    found = []
    for item in items:
        target = item.func if isinstance(item, ast.Call) else item
        if isinstance(target, ast.Attribute) and target.attr == mark and ast.unparse(target.value) == "pytest.mark":
            found.append(item)
    return found


def _exercise_names(marks: list, where: str) -> tuple[str, ...]:
    names = []
    for mark in marks:
        args = mark.args if isinstance(mark, ast.Call) else []
        if not args or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args):
            raise ValueError(f"{where}: pytest.mark.exercise takes the exercise names as plain strings")
        names += [a.value for a in args]
    return tuple(names)


def _marks_of(decorators: list[ast.expr]) -> tuple[list, bool]:
    """(the exercise marks, whether a slow or gpu mark is among them) of a decorator list."""
    exercise, slow = [], False
    for d in decorators:
        exercise += _mark_names(d, "exercise")
        slow = slow or bool(_mark_names(d, "slow") or _mark_names(d, "gpu"))
    return exercise, slow


def marked_tests_in(path: Path, week: int, rel: str) -> list[MarkedTest]:
    """The marked nodes of one test module (`rel`: its path as pytest names it)."""
    tree = ast.parse(path.read_text(), str(path))
    module_marks, module_slow = [], False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            module_marks, module_slow = _marks_of([node.value])
    found = []
    if module_marks:
        found.append(MarkedTest(rel, week, _exercise_names(module_marks, rel), not module_slow))

    def visit(body: list[ast.stmt], prefix: str, slow: bool) -> None:
        for node in body:
            is_test = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
            is_class = isinstance(node, ast.ClassDef) and node.name.startswith("Test")
            if not (is_test or is_class):
                continue
            marks, own_slow = _marks_of(node.decorator_list)
            nodeid = f"{prefix}::{node.name}"
            if marks:
                found.append(MarkedTest(nodeid, week, _exercise_names(marks, nodeid), not (slow or own_slow)))
            if is_class:
                visit(node.body, nodeid, slow or own_slow)

    visit(tree.body, rel, module_slow)
    return found


def marked_tests(tests_dir: Path = TESTS_DIR) -> list[MarkedTest]:
    """Every marked node of tests/weekNN/, week by week."""
    found = []
    for folder in sorted(tests_dir.glob("week[0-9][0-9]")):
        week = int(folder.name[4:])
        for path in sorted(folder.rglob("test_*.py")):
            found += marked_tests_in(path, week, path.relative_to(tests_dir.parent).as_posix())
    return found


def tests_of(week: int, name: str, tests: list[MarkedTest] | None = None) -> list[MarkedTest]:
    """The marked nodes that check exercise `name` of `week`."""
    return [t for t in (marked_tests() if tests is None else tests) if t.week == week and name in t.exercises]


def lesson_order(week: int, names: list[str], lessons_dir: Path = LESSONS_DIR) -> list[str]:
    """`names` (a week's exercises) in the order of the lesson's `### \\`name\\`` headings; any the
    lesson does not head (it should: a test checks it) follow, in the order given."""
    ordered = list(dict.fromkeys(h for h in lesson_headings(week, lessons_dir) if h in names))
    return ordered + [n for n in names if n not in ordered]


def lesson_headings(week: int, lessons_dir: Path = LESSONS_DIR) -> list[str]:
    """The names of the lesson's `### \\`name\\`` headings, in order."""
    path = lessons_dir / f"week{week:02d}" / "README.md"
    return HEADING.findall(path.read_text(encoding="utf-8")) if path.is_file() else []
