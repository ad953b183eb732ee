"""The package's floor plan holds: imports point down the layers, and no room grows too big.

The folders of `nanoserve/` are its layers (docs/architecture.md, "The layers"). A module
imports only from its own folder and from folders below it; the check reads every module with
`ast`, imports inside functions included, so an upward import cannot hide in a lazy import.
Also: `course/` imports nothing else of nanoserve (it is copied into learners' workspaces), the
scheduler and the sampling parameters import no torch, no module imports another module's
private (`_name`) names, no two modules import each other (directly or in a circle), no file
passes about 500 lines and no function about 80 (a Triton kernel's body excepted).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoserve"  # the reference, even in a workspace run

# From the bottom up. "top" is the package's own files: cli.py, testing.py, __init__.py.
LAYERS = ("course", "model", "kernels", "sampling", "scheduler", "attention", "runner", "engine", "server",
          "bench", "top")
MAX_FILE_LINES = 520
MAX_FUNCTION_LINES = 80
TORCH_FREE = ("scheduler/", "sampling/params.py", "sampling/__init__.py", "course/")


def layer_of(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else "top"


def module_name(rel: Path) -> str:
    parts = ("nanoserve",) + rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path) -> dict[Path, ast.Module]:
    return {p.relative_to(package): ast.parse(p.read_text(), str(p))
            for p in sorted(package.rglob("*.py")) if "__pycache__" not in p.parts}


def imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of the tree, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def nanoserve_targets(module: str, names: list[str]) -> list[str]:
    """The nanoserve modules one import statement reaches (`from nanoserve.bench import prefix`
    reaches nanoserve.bench.prefix)."""
    if module != "nanoserve" and not module.startswith("nanoserve."):
        return []
    return [f"{module}.{n}" for n in names] if module.count(".") <= 1 and names else [module]


def upward_imports(package: Path) -> list[str]:
    """Every import that points up the layers (or out of course/), as readable lines."""
    bad = []
    for rel, tree in modules(package).items():
        own = layer_of(rel)
        for line, module, names in imports(tree):
            for target in nanoserve_targets(module, names):
                if target == "nanoserve":  # the package root (its version, its path) is no layer
                    continue
                parts = target.split(".")
                layer = parts[1] if len(parts) > 1 and parts[1] in LAYERS else "top"
                if own == "course" and layer != "course":
                    bad.append(f"nanoserve/{rel}:{line} imports {target}: course/ imports no other nanoserve code")
                elif LAYERS.index(layer) > LAYERS.index(own):
                    bad.append(f"nanoserve/{rel}:{line} ({own}) imports {target} ({layer}): an import pointing up")
    return bad


def test_imports_point_down_the_layers():
    assert upward_imports(PACKAGE) == []


def test_the_check_catches_a_planted_upward_import(tmp_path):
    copy = tmp_path / "nanoserve"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (copy / "model" / "planted.py").write_text(
        "def build():\n    from nanoserve.engine.engine import Engine  # lazy, inside a function\n\n"
        "    return Engine\n")
    (copy / "course" / "planted.py").write_text("from nanoserve.model import config\n")
    found = upward_imports(copy)
    assert len(found) == 2, found
    assert "nanoserve/model/planted.py:2 (model) imports nanoserve.engine.engine (engine)" in found[1]
    assert "course/ imports no other nanoserve code" in found[0]


def test_every_folder_is_a_known_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name not in ("__pycache__", "assets")}
    assert folders == set(LAYERS) - {"top"}
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == {"__init__.py", "cli.py", "testing.py"}


def test_no_torch_in_the_scheduler_and_the_sampling_parameters():
    for rel, tree in modules(PACKAGE).items():
        if any(str(rel).startswith(prefix) for prefix in TORCH_FREE):
            torch = [line for line, module, _ in imports(tree) if module.split(".")[0] in ("torch", "triton")]
            assert not torch, f"nanoserve/{rel} imports torch (line {torch})"


def test_no_module_imports_another_modules_private_names():
    bad = []
    for rel, tree in modules(PACKAGE).items():
        for line, module, names in imports(tree):
            if module.startswith("nanoserve"):
                # (a dunder such as `__version__` is a module's public face, not a private name)
                bad += [f"nanoserve/{rel}:{line} imports {module}.{n}" for n in names
                        if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    assert bad == []


def import_graph(package: Path) -> dict[str, set[str]]:
    trees = modules(package)
    known = {module_name(rel) for rel in trees}
    graph: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        me = module_name(rel)
        edges = graph.setdefault(me, set())
        for _, module, names in imports(tree):
            for target in nanoserve_targets(module, names):
                while target not in known and "." in target:  # `from m import name` reaches m
                    target = target.rsplit(".", 1)[0]
                if target != me and not me.startswith(target + "."):  # (a package's face is not a circle)
                    edges.add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles, each once (Tarjan's strongly connected components of size > 1)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph(PACKAGE)) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def is_triton_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


@pytest.mark.parametrize("rel", sorted(modules(PACKAGE)), ids=str)
def test_rooms_stay_small(rel: Path):
    path = PACKAGE / rel
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"nanoserve/{rel} has {lines} lines: split it along what it does"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"nanoserve/{rel}: {node.name} has {length} lines"
