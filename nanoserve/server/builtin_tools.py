"""Issue 38: the tools the server itself owns (nanoserve/server/toolbox.py hands them to the model).

    calculator     an arithmetic expression, read by walking Python's `ast` (never `eval`)
    current_time   now, in UTC or in an IANA time zone
    read_file      a UTF-8 text file under --tools-dir, at most READ_CAP bytes
    list_files     the entries of a folder under --tools-dir

Each is a `Builtin`: a name, a description and a JSON schema for the model, and `run(arguments)`,
which returns the text the model reads or raises `ToolFailure` with a one-line reason. Everything a
request can make a tool do is bounded: the calculator's input length, exponents and integer sizes;
the bytes a file read returns; the entries a listing returns. Nothing outside --tools-dir can be
read: absolute paths and `..` are refused, and a path is resolved (symlinks followed) before it is
checked, so a link that points out of the folder is refused too.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

MAX_EXPRESSION = 500  # characters of a calculator expression
MAX_EXPONENT = 10_000  # |b| in a ** b
MAX_INT_BITS = 14_000  # the largest integer the calculator makes (about 4,200 digits: str() takes 4,300)
READ_CAP = 65_536  # bytes read_file returns at most: a larger file is refused
LIST_CAP = 200  # entries list_files returns at most


class ToolFailure(Exception):
    """A tool could not do what it was asked; the message (one line) goes back to the model."""


@dataclass
class Builtin:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments: an object of strings (what `check_arguments` reads)
    run: Callable[[dict], str]


def schema(required: dict[str, str], optional: dict[str, str] | None = None) -> dict:
    """An object schema whose properties are strings: {name: description}."""
    props = {name: {"type": "string", "description": text} for name, text in {**required, **(optional or {})}.items()}
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def check_arguments(parameters: dict, arguments) -> str | None:
    """Why `arguments` do not fit a `schema()` (missing, unknown, not a string), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    missing = [name for name in parameters["required"] if name not in arguments]
    unknown = [name for name in arguments if name not in parameters["properties"]]
    wrong = [name for name, value in arguments.items() if name in parameters["properties"] and not isinstance(value, str)]
    for what, names in (("missing", missing), ("unknown", unknown), ("not a string", wrong)):
        if names:
            return f"{what} argument(s): {', '.join(sorted(names))} (expected: {', '.join(parameters['properties'])})"
    return None


# ------------------------------------------------------------------------------ calculator

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
FUNCTIONS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos,
             "tan": math.tan, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil}
CONSTANTS = {"pi": math.pi, "e": math.e}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses, unary minus,
    `pi`, `e` and the one-argument `FUNCTIONS`. Anything else (names, attributes, strings, calls of
    other functions) raises `ToolFailure`, as do division by zero and results past the bounds."""
    if len(expression) > MAX_EXPRESSION:
        raise ToolFailure(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolFailure(f"not an arithmetic expression: {expression!r}") from None
    try:
        value = evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolFailure("division by zero") from None
    except (OverflowError, ValueError, RecursionError) as e:  # math.sqrt(-1), 1e308 ** 2, ...
        raise ToolFailure(f"no result: {e}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolFailure("the result is not a finite number")
    return value


def evaluate(node: ast.AST) -> int | float:
    """One node of the tree, its children first; each integer made is checked against MAX_INT_BITS."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return bounded(node.value)
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            check_power(left, right)
        return bounded(BINARY[type(node.op)](left, right))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and len(node.args) == 1 and not node.keywords):
        return bounded(FUNCTIONS[node.func.id](evaluate(node.args[0])))
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = f"a call (allowed: {', '.join(FUNCTIONS)} with one argument)"
    raise ToolFailure(f"not allowed in an expression: {what}")


def check_power(base, exponent) -> None:
    """Refuse a power whose size alone would burn the CPU: 10 ** 10 ** 10 takes the calculator out."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolFailure(f"exponent {exponent:g} is past the limit of {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and abs(base).bit_length() * exponent > MAX_INT_BITS:
        raise ToolFailure(f"the result would be larger than {MAX_INT_BITS} bits")
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise ToolFailure("a negative number to a fractional power is not a real number")


def bounded(value):
    if isinstance(value, complex):
        raise ToolFailure("the result is not a real number")
    if isinstance(value, int) and abs(value).bit_length() > MAX_INT_BITS:
        raise ToolFailure(f"the result would be larger than {MAX_INT_BITS} bits")
    return value


def run_calculator(arguments: dict) -> str:
    value = calculate(arguments["expression"])
    return str(value) if isinstance(value, int) else format(value, ".15g")


CALCULATOR_SCHEMA = schema({"expression": "an arithmetic expression, e.g. (2 + 3) * 4 ** 2 / 7"})


# ------------------------------------------------------------------------------ current_time


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def current_time(arguments: dict, clock: Callable[[], datetime] = utc_now) -> str:
    """Now, ISO 8601 to the second: in UTC, or in the IANA zone `timezone` names ("Europe/Paris")."""
    now = clock().astimezone(timezone.utc).replace(microsecond=0)
    name = arguments.get("timezone")
    if name is None:
        return now.isoformat()
    try:
        zone = ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ToolFailure(f"unknown time zone {name!r} (an IANA name such as 'Europe/Paris' or 'UTC')") from None
    return f"{now.astimezone(zone).isoformat()} ({name})"


TIME_SCHEMA = schema({}, {"timezone": "an IANA time zone such as 'America/New_York' (default: UTC)"})


# ------------------------------------------------------------------------------ files


def inside(root: Path, relative: str) -> Path:
    """`relative` under `root` (already resolved), symlinks followed; refused if it leaves `root`."""
    if not relative or Path(relative).is_absolute() or relative.startswith("~"):
        raise ToolFailure(f"give a path relative to the tools directory, not {relative!r}")
    try:
        path = (root / relative).resolve(strict=True)
    except FileNotFoundError:
        raise ToolFailure(f"no such file or folder: {relative}") from None
    except (OSError, RuntimeError) as e:  # a symlink loop, a name too long
        raise ToolFailure(f"cannot open {relative}: {e}") from None
    if not path.is_relative_to(root):
        raise ToolFailure(f"{relative} is outside the tools directory: refused")
    return path


def read_file(root: Path, arguments: dict) -> str:
    path = inside(root, arguments["path"])
    if not path.is_file():
        raise ToolFailure(f"{arguments['path']} is not a regular file")
    with path.open("rb") as f:
        data = f.read(READ_CAP + 1)
    if len(data) > READ_CAP:
        raise ToolFailure(f"{arguments['path']} is larger than the {READ_CAP}-byte cap of read_file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolFailure(f"{arguments['path']} is not UTF-8 text") from None


def list_files(root: Path, arguments: dict) -> str:
    path = inside(root, arguments.get("path") or ".")
    if not path.is_dir():
        raise ToolFailure(f"{arguments.get('path')} is not a folder")
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f"\n... and {len(names) - LIST_CAP} more" if len(names) > LIST_CAP else ""
    return "\n".join(names[:LIST_CAP]) + more if names else "(empty folder)"


# ------------------------------------------------------------------------------ the set

FILE_TOOLS = ("read_file", "list_files")  # the built-ins that need --tools-dir
BUILTIN_NAMES = ("calculator", "current_time", *FILE_TOOLS)


def make_builtin(name: str, tools_dir: str | Path | None = None,
                 clock: Callable[[], datetime] = utc_now) -> Builtin:
    """The built-in tool `name`; the file tools read under `tools_dir` (which they need)."""
    if name == "calculator":
        return Builtin(name, "Evaluate an arithmetic expression (+ - * / // % **, parentheses, pi, e, "
                             f"{', '.join(FUNCTIONS)}) and return its value.", CALCULATOR_SCHEMA, run_calculator)
    if name == "current_time":
        return Builtin(name, "The current date and time (ISO 8601), in UTC or in the given IANA time zone.",
                       TIME_SCHEMA, lambda arguments: current_time(arguments, clock))
    if name not in FILE_TOOLS:
        raise ValueError(f"no built-in tool {name!r} (--server-tools takes: {', '.join(BUILTIN_NAMES)})")
    if tools_dir is None:
        raise ValueError(f"the built-in tool {name} reads files under --tools-dir: give --tools-dir DIR")
    root = Path(tools_dir).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"--tools-dir {tools_dir}: not a folder")
    if name == "read_file":
        return Builtin(name, f"Read a UTF-8 text file (at most {READ_CAP} bytes) from the tools directory; "
                             "the path is relative to that directory.",
                       schema({"path": "the file's path, relative to the tools directory"}),
                       lambda arguments: read_file(root, arguments))
    return Builtin(name, f"List the files and folders (folders end with /; at most {LIST_CAP}) in a folder of "
                         "the tools directory.",
                   schema({}, {"path": "a folder, relative to the tools directory (default: the directory itself)"}),
                   lambda arguments: list_files(root, arguments))
