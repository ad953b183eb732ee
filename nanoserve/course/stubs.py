"""Which weeks are still stubs in the running package.

Standard library only, and no import of the rest of nanoserve: this file (with the folder's
`__init__.py`) is copied as it is into every learner's workspace, so the engine can ask it
there too (`stubbed_weeks`) without depending on how the reference was installed.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the nanoserve/ this file belongs to
ENV_VAR = "NANOSERVE_WORKSPACE"  # names a learner's workspace (tests, notebooks, benchmarks)
COPIED = (Path("course/__init__.py"), Path("course/stubs.py"))  # into every workspace, unchanged


def source_files(package: Path = PACKAGE_DIR) -> list[Path]:
    """The package's Python files that may hold exercises: all but the course machinery (whose
    docstrings show marker pairs, and which a workspace gets unchanged or not at all)."""
    return sorted(p.relative_to(package) for p in package.rglob("*.py")
                  if "__pycache__" not in p.parts and p.relative_to(package).parts[0] != "course")


def stubbed_weeks(package: Path | None = None) -> frozenset[int]:
    """The weeks with an exercise still a stub in the package this file sits in (or in
    `package`): none in the reference; in a learner's workspace, the weeks not written yet.
    Features that are on by default from a bonus week on (week 14's prefix caching) stay off
    until that week is done."""
    return _stubbed_weeks(package or PACKAGE_DIR)


@functools.lru_cache(maxsize=None)
def _stubbed_weeks(package: Path) -> frozenset[int]:
    stub = re.compile(r'raise NotImplementedError\("week (\d\d) exercise')
    return frozenset(int(m.group(1)) for rel in source_files(package)
                     for m in stub.finditer((package / rel).read_text()))


def workspace_from_env() -> Path | None:
    """The workspace NANOSERVE_WORKSPACE names, resolved (None when the variable is not set).

    Raises FileNotFoundError if it holds no `nanoserve/` package."""
    value = os.environ.get(ENV_VAR)
    if not value:
        return None
    workspace = Path(value).expanduser().resolve()
    if not (workspace / "nanoserve" / "__init__.py").is_file():
        raise FileNotFoundError(f"{ENV_VAR}={value} holds no nanoserve/ package: run `nanoserve course start "
                                "--week N` first, or unset the variable to use the reference")
    return workspace
