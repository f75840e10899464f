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
