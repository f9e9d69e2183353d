"""The router's place in the import order: it reads requests with the server's protocol
and prompt modules only, so it starts without the engine or torch; and no import cycle
closes among server/ and router/ modules, TYPE_CHECKING imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import openinfer

PACKAGE = Path(openinfer.__file__).parent

KNOWN_CYCLES = {frozenset({"openinfer.router.launch", "openinfer.router.ray_backend"})}
"""Cycles through function-level imports that another change removes (free_ports and
_strip to a leaf procs module); a new cycle fails the test."""


def test_router_imports_neither_the_engine_nor_torch():
    probe = ("import sys, openinfer.router.app\n"
             "bad = sorted(m for m in sys.modules if m.startswith('openinfer.engine') or m in "
             "('torch', 'openinfer.server.anthropic_api', 'openinfer.server.app'))\n"
             "print(' '.join(bad))")
    # A fresh interpreter: this one has long since imported the engine for other tests.
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere: at module level, in a
    function or under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_server_and_router_modules():
    files = [*(PACKAGE / "server").glob("*.py"), *(PACKAGE / "router").glob("*.py")]
    modules = {_module_name(f) for f in files}
    graph = {_module_name(f): _imports(f, modules) - {_module_name(f)} for f in files}
    assert set(_cycles(graph)) <= KNOWN_CYCLES
