"""The ``orchestrator`` package's modules import each other without a cycle.

The graph is read from the source (``ast``), so it counts every import: at module level,
inside functions, and under ``if TYPE_CHECKING``.  A request's path through the code then
goes one way (handler -> service -> registry -> archive/engine client), never back up.
"""

from __future__ import annotations

import ast
import functools
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "orchestrator"


def module_name(path: Path) -> str:
    """``orchestrator/api/llama_server/slots.py`` -> ``orchestrator.api.llama_server.slots`` (a package is its ``__init__``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that module ``name``'s source imports (``from x import y`` counts ``x.y``
    when that is a module, else ``x``)."""
    out: set[str] = set()
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a.b.c where only a.b is a module of ours
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports."""
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    known = {module_name(f) for f in files}
    return {
        module_name(f): imported(ast.parse(f.read_text(), str(f)), module_name(f), f.name == "__init__.py", known)
        for f in files
    }


def test_the_import_graph_is_read_from_every_module() -> None:
    graph = import_graph()
    assert "orchestrator.slots.registry" in graph and "orchestrator.api.llama_server.slots" in graph
    assert "orchestrator.slots.persistence" in graph["orchestrator.slots.registry"]
    assert "orchestrator.slots.registry" in graph["orchestrator.api.llama_server.slots"]


def test_the_orchestrator_has_no_import_cycle() -> None:
    try:
        order = list(TopologicalSorter(import_graph()).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle among the orchestrator's modules: {' -> '.join(exc.args[1])}") from None
    assert (
        order.index("orchestrator.slots.persistence")
        < order.index("orchestrator.slots.registry")
        < order.index("orchestrator.app")
    )


def test_a_cycle_would_be_found() -> None:
    """The reader sees imports under ``if TYPE_CHECKING`` and inside functions."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from orchestrator.b import X\n"
    source_b = "def f():\n    from orchestrator import a\n"
    known = {"orchestrator", "orchestrator.a", "orchestrator.b"}
    graph = {
        "orchestrator.a": imported(ast.parse(source), "orchestrator.a", False, known),
        "orchestrator.b": imported(ast.parse(source_b), "orchestrator.b", False, known),
    }
    assert graph == {"orchestrator.a": {"orchestrator.b"}, "orchestrator.b": {"orchestrator.a"}}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError:
        return
    raise AssertionError("the cycle a -> b -> a was not found")


def names_imported(path: Path) -> set[str]:
    """Every ``module`` and ``module.name`` a source file imports (``import m``, ``from m import n``)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_the_engine_does_not_import_storage() -> None:
    """The worker's package owns llama.cpp's formats; the store's package is the orchestrator's."""
    offenders = {
        str(f.relative_to(ROOT)): sorted(n for n in names_imported(f) if n == "storage" or n.startswith("storage."))
        for f in sorted((ROOT / "engine").rglob("*.py"))
    }
    assert {f: n for f, n in offenders.items() if n} == {}


def test_only_the_engine_client_touches_its_receive_buffers() -> None:
    """The transport's buffer pool is the worker client's: the rest hands states back through
    ``EngineClient.release_state``, so another client implementation gets them too."""
    users = [
        str(f.relative_to(ROOT))
        for f in sorted((ROOT / PACKAGE).rglob("*.py"))
        if "contract.framing.RECEIVE_POOL" in names_imported(f)
    ]
    assert users == ["orchestrator/engine_client/client.py"]


DOMAIN = ("orchestrator.slots", "orchestrator.generation", "orchestrator.engine_client")
"""The domain packages: slots, generation and the engine client side."""
SURFACES = ("orchestrator.web", "orchestrator.api", "orchestrator.admin")
"""HTTP plumbing, the API surfaces and the admin page: what the domain must not know."""


def test_the_domain_knows_no_surface() -> None:
    """Slots, generation and the engine client import nothing of HTTP, the API surfaces or the admin
    page: they raise :class:`orchestrator.service_error.ServiceError`, mapped to HTTP once at the edge,
    and generation is handed its token watcher (the admin feed) instead of importing it."""
    graph = import_graph()
    leaks = {
        module: sorted(t for t in targets if t.startswith(SURFACES))
        for module, targets in graph.items()
        if module.startswith(DOMAIN)
    }
    assert "orchestrator.generation.service" in leaks and "orchestrator.slots.registry" in leaks
    assert {m: t for m, t in leaks.items() if t} == {}


API = "orchestrator.api"
COMMON = "orchestrator.api.common"


def package_of(module: str) -> str:
    """The package a module counts for in the package rules: an API surface (``orchestrator.api.openai``), the
    surfaces' common package, or a first-level package or module of the orchestrator (``orchestrator.slots``)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "api":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def package_graph() -> dict[str, set[str]]:
    """Every package (:func:`package_of`) -> the packages its modules import."""
    out: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        here = package_of(module)
        out.setdefault(here, set()).update(package_of(t) for t in targets if package_of(t) != here)
    return out


def surfaces() -> list[str]:
    """The API surfaces: every package under ``orchestrator/api/`` but the common one."""
    return sorted(f"{API}.{p.name}" for p in (ROOT / "orchestrator" / "api").iterdir() if (p / "__init__.py").exists())


def test_the_packages_have_no_import_cycle() -> None:
    """The module graph can be acyclic while two packages still import each other (slots -> generation ->
    slots through different modules); the package graph forbids that too."""
    graph = package_graph()
    assert {"orchestrator.slots", "orchestrator.generation", "orchestrator.admin", "orchestrator.services"} <= set(
        graph
    )
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle among the orchestrator's packages: {' -> '.join(exc.args[1])}") from None


def test_api_surfaces_are_siblings() -> None:
    """An API surface imports the common package and the domain, never another surface; the common package
    imports no surface."""
    names = surfaces()
    assert {f"{API}.openai", f"{API}.anthropic", f"{API}.llama_server", f"{API}.native", f"{API}.kobold"} <= set(names)
    assert COMMON in names
    graph = package_graph()
    crossing = {s: sorted(t for t in graph.get(s, set()) if t in names and t != COMMON) for s in names}
    assert {s: t for s, t in crossing.items() if t} == {}


def test_a_package_cycle_would_be_found() -> None:
    """Two packages importing each other through different modules: the module graph has no cycle, the
    package graph has one."""
    modules = {
        "orchestrator.slots.a": {"orchestrator.generation.b"},
        "orchestrator.generation.c": {"orchestrator.slots.d"},
    }
    graph: dict[str, set[str]] = {}
    for module, targets in modules.items():
        graph.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
    list(TopologicalSorter(modules).static_order())  # the modules alone: no cycle
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError:
        return
    raise AssertionError("the cycle slots -> generation -> slots was not found")
