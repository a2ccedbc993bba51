"""The package's structure: modules import each other one way, other libraries' privates live in _compat, and
no class grows past 300 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "optuna_rapidfire"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Package modules imported, for typing (``if TYPE_CHECKING:``) too, deferred imports too: a module that
    names another's type depends on it as much as one that calls it."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def test_no_import_cycles() -> None:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(ast.parse(path.read_text()), set(files)) - {name} for name, path in files.items()}
    cycles = []

    def walk(start: str, node: str, path: list[str], seen: set[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycles.append([*path, start])
            elif nxt not in seen:
                seen.add(nxt)
                walk(start, nxt, [*path, nxt], seen)

    for name in graph:
        walk(name, name, [name], {name})
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_other_libraries_private_modules_are_imported_only_in_compat() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module):
                continue
            parts = node.module.split(".")
            if parts[0] not in ("optuna_rapidfire", "__future__") and any(p.startswith("_") for p in parts):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} from {node.module}")
    assert offenders == [], "\n".join(offenders)


# The package's floors, top to bottom: the front (what users call), the Optuna side of a trial's life, one
# device's runtime, the engines, the trainer kinds, then what lives on the device and the kernels, then leaves.
FLOORS = {"_study": 5, "_runtime": 4, "_engines": 3, "_trainers": 2, "_fused": 1, "_resident": 1}
LEAVES = {
    "optuna_rapidfire._compat",
    "optuna_rapidfire._logging",
    "optuna_rapidfire._budget",
    "optuna_rapidfire.events",
}


def _floor(module: str) -> int | None:
    """A module's floor (``None``: the front, the demo and the samplers, which may import anything)."""
    if module in LEAVES:
        return 0
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_each_floor_imports_only_the_floors_below_it() -> None:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    upward = []
    for name, path in files.items():
        own = _floor(name)
        if own is None:
            continue
        for imported in _imports(ast.parse(path.read_text()), set(files)):
            theirs = _floor(imported)
            if theirs is None or (theirs > own and imported.split(".")[1] != name.split(".")[1]):
                upward.append(f"{name} -> {imported}")
    assert upward == [], "\n".join(upward)


MAX_CLASS_LINES = 300
"""A class longer than this does more than one job: split it (issue 23's rule)."""


def test_no_class_is_over_300_lines() -> None:
    long: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = lines
    assert long == {}
