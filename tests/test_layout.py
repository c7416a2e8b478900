"""The package's rooms (docs/architecture.md): the host side under ``jaxserve/core`` imports no jax, no two modules
import each other (directly or around a circle, lazy and type-only imports counted), few modules sit flat in
``jaxserve/``, the kernels stand alone, and every package is in the wheel."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOPS = (("jaxserve", "jaxserve"), ("kernels", "jaxserve.kernels"))  # folder, package name (kernels/ installs inside)


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    out = {}
    for top, name in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join([name, *(parts[:-1] if init else parts)])] = (path, init)
    return out


def imported(module: str, init: bool, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The modules an import statement names (``from a import b``: ``a.b`` when that is a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module if init else module.rpartition(".")[0]
    for _ in range(max(node.level - 1, 0)):
        base = base.rpartition(".")[0]
    source = (base + ("." + node.module if node.module else "")) if node.level else node.module
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its text: at the top, inside functions (lazy) and
    under ``if TYPE_CHECKING`` alike. Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` too."""
    known = modules()
    graph = {}
    for module, (path, init) in known.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in imported(module, init, node, known):
                parts = name.split(".")
                # the parents' __init__ run first (``jaxserve``'s own, which imports nothing, only when named)
                for i in range(1 if name == "jaxserve" else 2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in known and dep != module and (dep == name or not module.startswith(dep + ".")):
                        deps.add(dep)
        graph[module] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e", "e2"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100 and "jaxserve.core.sched.scheduler" in graph
    # the graph sees lazy and type-only imports: the engine's request state names its replica only for typing
    assert "jaxserve.engine.replica" in graph["jaxserve.engine.request_state"]
    assert circles(graph) == []


def test_few_modules_flat():
    flat = sorted(p.name for p in (ROOT / "jaxserve").glob("*.py"))
    assert len(flat) <= 12, flat


def test_core_imports_without_jax():
    """Every module under ``jaxserve/core`` (the scheduler, block manager, requests, sampling parameters, outputs,
    KV events) imports in a fresh interpreter without jax, jaxlib or flax."""
    core = sorted(m for m in modules() if m == "jaxserve.core" or m.startswith("jaxserve.core."))
    assert "jaxserve.core.sched.scheduler" in core and len(core) >= 8
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {core!r}]; "
        "from jaxserve import SamplingParams; "
        "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]; "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_kernels_import_no_engine_module():
    """``jaxserve.kernels`` (the top-level ``kernels/`` folder) stands alone: no module of it imports a ``jaxserve``
    module outside ``jaxserve.kernels`` (the engine imports the kernels, never the other way)."""
    graph = import_graph()
    kernels = [m for m in graph if m.startswith("jaxserve.kernels")]
    assert len(kernels) > 5
    bad = {m: sorted(d for d in graph[m] if not d.startswith("jaxserve.kernels")) for m in kernels}
    assert not {m: d for m, d in bad.items() if d}


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages by hand (kernels/ installs as jaxserve.kernels): a new subpackage left out
    would import from a checkout (editable install) and be missing from a wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {m for m, (_, init) in modules().items() if init}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
