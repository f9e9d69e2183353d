"""The package's import order (docs/design.md, "Layers"): every import of an openinfer module,
at module level, inside a function or under TYPE_CHECKING, points down this order; no import
cycle; and the control plane (scheduler, KV manager, router) loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "openinfer"

LAYERS: list[tuple[str, ...]] = [
    # Leaves: no openinfer import.
    ("openinfer", "openinfer.procs", "openinfer.units", "openinfer.logger", "openinfer.cpu_features",
     "openinfer.huge_pages", "openinfer.gc_heap", "openinfer.cpu_allocator", "openinfer.model_source",
     "openinfer.gguf_file", "openinfer.tokenizer", "openinfer.config_file", "openinfer.env_flags"),
    # What a request asks for, and what it gets back.
    ("openinfer.sampling_params", "openinfer.outputs", "openinfer.structured.params",
     "openinfer.kv.remote", "openinfer.spec.config"),
    ("openinfer.config", "openinfer.engine_args"),
    # The control plane: pure Python over integers.
    ("openinfer.kv", "openinfer.structured", "openinfer.spec.proposer", "openinfer.spec.ngram",
     "openinfer.spec.suffix", "openinfer.spec.planner", "openinfer.spec.confidence",
     "openinfer.spec.budget",
     "openinfer.engine.request", "openinfer.engine.outputs", "openinfer.engine.admission",
     "openinfer.engine.scheduler"),
    # Compute, bottom up.
    ("openinfer.kernels",),
    ("openinfer.distributed",),
    ("openinfer.attention",),
    ("openinfer.layers",),
    ("openinfer.models",),
    ("openinfer.sample",),
    ("openinfer.spec",),  # the model drafters
    ("openinfer.transfer",),
    ("openinfer.worker",),
    ("openinfer.executor",),
    ("openinfer.engine.protocol", "openinfer.engine.rank_results", "openinfer.engine.kv_connector",
     "openinfer.engine.core"),
    ("openinfer.engine.core_proc",),
    # The front ends.
    ("openinfer.engine",),
    ("openinfer.llm", "openinfer.demo"),
    ("openinfer.server",),
    ("openinfer.router",),
    ("openinfer.bench",),
    ("openinfer.cli", "openinfer.engine_flags", "openinfer.__main__"),
]
"""Groups, lowest first: a module may import from its own group and the ones above it in
this list. A module belongs to the group of the longest name that prefixes it (the package's
own ``__init__``, ``openinfer``, only to its own: it imports leaves, and the public classes by
name on first use)."""

OPTIONAL_DEPENDENCIES = ("ray", "triton")
"""Imported where used: a module that needs one (itself or through its module-level imports)
may be imported inside a function, across packages."""

LAZY_ENTRY_POINTS = {
    "openinfer.cli": "each subcommand imports what it runs: `openinfer router` loads no torch",
    "openinfer.router.launch": "the router's tokenizer and the Ray launcher load only when asked",
}
"""Modules whose function-level imports across packages are their purpose, and why."""

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
DECLARATIVE = {"openinfer/engine_flags.py:add_engine_args", "openinfer/cli.py:build_parser"}
"""Argument parsers: one flag after another, nothing to split."""
OVERSIZED = {
    # A Triton kernel's body: split into jit helpers once a GPU can time the compiled code.
    "openinfer/kernels/triton_attention.py:_attention_kernel",
}
"""Known files and functions over the limits, each to be split; the test fails on a new one
and on one that no longer is (take it off the list)."""

CONTROL_PLANE = ["openinfer.engine.scheduler", "openinfer.router.app", "openinfer.router.launch",
                 *sorted(f"openinfer.kv.{p.stem}" for p in (PACKAGE / "kv").glob("*.py")
                         if p.stem != "__init__")]
"""Modules whose import must load no torch."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module ``name`` lives in (``openinfer.a.b.Class`` -> ``openinfer.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, int, str]]:
    """(imported module, line, how: module / function / type-checking) for each openinfer
    import of ``module``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "type-checking")
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), how)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, "function" if how == "module" else how)
            elif isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, how) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                found.extend((f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base,
                              child.lineno, how) for a in child.names)
            else:
                visit(child, how)

    visit(ast.parse(path.read_text()), "module")
    return [(target, line, how) for name, line, how in found
            if name.split(".")[0] == "openinfer" and (target := _resolve(name)) not in (None, module)]


EDGES = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            covers = module == prefix or (prefix != "openinfer" and module.startswith(prefix + "."))
            if covers and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no group of LAYERS: place it"
    return rank


def test_every_import_points_down_the_order():
    upward = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{line} imports {target} ({how})"
              for m, edges in EDGES.items() for target, line, how in edges
              if _layer(target) > _layer(m)]
    assert not upward, "imports against the order:\n" + "\n".join(sorted(upward))


def _needs_optional_dependency(module: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether importing ``module`` imports ray or triton (itself or at module level below)."""
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in OPTIONAL_DEPENDENCIES for n in names):
            return True
    return any(_needs_optional_dependency(t, seen | {module}) for t, _, how in EDGES[module]
               if how == "module" and t not in seen)


def test_no_function_level_import_crosses_packages():
    """An import inside a function hides a dependency (and used to hide cycles): between
    packages, imports are made at module level, but for optional dependencies and the
    LAZY_ENTRY_POINTS."""
    def package(module: str) -> str:
        return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]

    hidden = [f"{MODULES[m].relative_to(PACKAGE.parent)}:{line} imports {target}"
              for m, edges in EDGES.items() if m not in LAZY_ENTRY_POINTS
              for target, line, how in edges
              if how == "function" and package(target) != package(m)
              and not _needs_optional_dependency(target)]
    assert not hidden, "function-level imports across packages:\n" + "\n".join(sorted(hidden))


def test_no_import_cycle():
    """Tarjan's strongly connected components over every import, type-checking ones too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in {t for t, _, _ in EDGES[v]}:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for module in MODULES:
        if module not in index:
            strong(module)
    assert not cycles, f"import cycles: {cycles}"


def _oversized() -> set[str]:
    found = set()
    for path in MODULES.values():
        name = str(path.relative_to(PACKAGE.parent))
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            found.add(name)
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES):
                found.add(f"{name}:{node.name}")
    return found - DECLARATIVE


def test_files_and_functions_stay_short():
    """Files of at most MAX_FILE_LINES lines and functions of at most MAX_FUNCTION_LINES,
    but for argument parsers and the OVERSIZED list."""
    found = _oversized()
    assert not found - OVERSIZED, f"over the limits: {sorted(found - OVERSIZED)}"
    assert not OVERSIZED - found, f"within the limits now (take off OVERSIZED): {sorted(OVERSIZED - found)}"


def test_the_walk_finds_each_kind_of_import(tmp_path):
    """At module level, in a function (nested too) and under TYPE_CHECKING, absolute and
    relative: a walk that missed some would pass everything."""
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import openinfer.units\n"
        "from ..config import EngineConfig\n"
        "if TYPE_CHECKING:\n"
        "    from openinfer.kv.block_pool import BlockPool\n"
        "class A:\n"
        "    def f(self):\n"
        "        def g():\n"
        "            from openinfer.logger import configure_logging\n")
    assert sorted(_imports("openinfer.kv.probe", source)) == [
        ("openinfer.config", 3, "module"), ("openinfer.kv.block_pool", 5, "type-checking"),
        ("openinfer.logger", 9, "function"), ("openinfer.units", 2, "module")]


@pytest.mark.parametrize("module", CONTROL_PLANE)
def test_control_plane_loads_no_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout, f"importing {module} loads torch"
