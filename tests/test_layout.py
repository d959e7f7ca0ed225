"""The code's layout rules (docs/ARCHITECTURE.md), read statically from the source: which package may import which,
no import cycle anywhere, and no function longer than a screen and a half."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "common", "scheduler", "worker", "kernels", "loraplane", "benchmarks")
MAX_FUNCTION_LINES = 80
# Outside the rule: GPU kernels (one Triton kernel is one function) and Alembic revisions (one migration each).
LONG_FUNCTIONS_ALLOWED = ("kernels", "migrations")


def python_files(*roots: str, base: Path = ROOT) -> Iterator[Path]:
    for root in roots:
        yield from sorted((base / root).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports too), as absolute names."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def offenders(roots: tuple[str, ...], forbidden: tuple[str, ...], base: Path = ROOT) -> list[str]:
    return sorted(f"{path.relative_to(base)} imports {module}"
                  for path in python_files(*roots, base=base) for module in imported_modules(path)
                  if any(module == f or module.startswith(f + ".") for f in forbidden))


IMPORT_RULES = [
    # Nothing imports the API (the CLI starts it by name).
    (("common", "scheduler", "worker", "kernels", "loraplane", "benchmarks"), ("api",)),
    # The kernels import nothing of ours.
    (("kernels",), ("api", "common", "scheduler", "worker", "loraplane")),
    # The planners and the early-exit policies are pure: no database, no bus, no service.
    (("scheduler/planning", "scheduler/early_exit"),
     ("sqlalchemy", "common.db", "common.tables", "common.bus", "celery", "scheduler.service", "scheduler.sim")),
    # The early-exit policies know nothing of planning; the offline tools nothing of the daemon.
    (("scheduler/early_exit",), ("scheduler.planning",)),
    (("scheduler/sim",), ("scheduler.service", "sqlalchemy", "common.db", "common.tables")),
    # The scheduler trains nothing.
    (("scheduler",), ("worker", "kernels", "torch")),
    # The common package is shared by all, so it imports none of them.
    (("common",), ("scheduler", "worker", "kernels", "loraplane")),
    # The API serves; it trains nothing and loads no model (its image has no torch).
    (("api",), ("torch", "transformers", "kernels", "worker")),
]


@pytest.mark.parametrize(("roots", "forbidden"), IMPORT_RULES)
def test_imports_point_one_way(roots: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert offenders(roots, forbidden) == []


def test_the_layout_check_sees_an_import_it_forbids(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from api.main import app\n    import scheduler.service.daemon as d\n")
    assert {"api.main", "api.main.app", "scheduler.service.daemon"} <= imported_modules(source)


@pytest.mark.parametrize(("roots", "forbidden"), IMPORT_RULES)
def test_each_import_rule_catches_a_violation(tmp_path: Path, roots: tuple[str, ...],
                                              forbidden: tuple[str, ...]) -> None:
    # A file under the rule's first root importing its first forbidden module, inside a function.
    offender = tmp_path / roots[0] / "offender.py"
    offender.parent.mkdir(parents=True)
    offender.write_text(f"def f():\n    import {forbidden[0]}.x\n")
    assert offenders(roots, forbidden, base=tmp_path) == [f"{roots[0]}/offender.py imports {forbidden[0]}.x"]
    offender.write_text("import json\n")
    assert offenders(roots, forbidden, base=tmp_path) == []


# The engine is the pure core a worker wraps: it imports the standard library, the numeric stack and our kernels
# (docs/ARCHITECTURE.md), never the service around it (common/, the worker's shell), so it runs and tests alone.
ENGINE_ROOT = "worker/engine"
ENGINE_MAY_IMPORT = ("torch", "transformers", "safetensors", "tokenizers", "liger_kernel", "torchao", "kernels",
                     "worker.engine")


def engine_rule_offenders(base: Path = ROOT) -> list[str]:
    return sorted(f"{path.relative_to(base)} imports {module}"
                  for path in python_files(ENGINE_ROOT, base=base) for module in imported_modules(path)
                  if module.split(".")[0] not in sys.stdlib_module_names
                  and not any(module == m or module.startswith(m + ".") for m in ENGINE_MAY_IMPORT))


def test_the_engine_imports_only_torch_its_libraries_and_the_kernels() -> None:
    assert engine_rule_offenders() == []


def test_the_engine_rule_catches_a_service_import(tmp_path: Path) -> None:
    engine = tmp_path / ENGINE_ROOT
    engine.mkdir(parents=True)
    (engine / "ok.py").write_text("import math\nimport torch.nn\nfrom kernels.x import y\n"
                                  "from worker.engine import z\n")
    assert engine_rule_offenders(tmp_path) == []
    (engine / "bad.py").write_text("def f():\n    from common.metrics import score\n    import worker.pack_runner\n")
    assert engine_rule_offenders(tmp_path) == [
        "worker/engine/bad.py imports common.metrics", "worker/engine/bad.py imports common.metrics.score",
        "worker/engine/bad.py imports worker.pack_runner"]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of ``packages`` under ``root`` -> the modules of theirs it imports, at any depth (an import inside
    a function placed there to dodge a cycle is still an edge). ``from pkg import name`` names the submodule
    ``pkg.name`` where there is one, else the package; a module's own package is no edge of its import."""
    paths = {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                         for a in node.names]
            for name in names:
                while name and name not in paths:  # `import a.b.c` of ours is an edge to the module a.b.c
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges if e not in index or e in stack), None)
            if child is not None and child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
                continue
            if child is not None:
                low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_anywhere() -> None:
    assert import_cycles(import_graph(ROOT, PACKAGES)) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import a\n")  # a package importing its own modules: no cycle
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a, b\n")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]
    (package / "c.py").write_text("import json\n")
    assert import_cycles(import_graph(tmp_path, ("pkg",))) == []


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_80_lines() -> None:
    roots = tuple(p for p in (*PACKAGES, "tests") if p not in LONG_FUNCTIONS_ALLOWED)
    assert [f for path in python_files(*roots) for f in long_functions(path)] == []


def test_the_length_check_counts_a_long_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("class C:\n    async def f(self):\n" + "        x = 1\n" * MAX_FUNCTION_LINES)
    assert len(long_functions(source)) == 1  # 81 lines
    source.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    assert long_functions(source) == []  # 80 lines
