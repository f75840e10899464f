"""One owner for a slot: only the registry writes ``Slot`` fields and calls the engine's KV operations.

Read from the source (``ast``): every assignment to an attribute named like a
:class:`orchestrator.slots.model.Slot` field (on anything but ``self``) and every call of a KV
operation on an engine (``<...>engine.seq_op(...)``, ``.restore(...)``, ``.erase(...)``, ...).
The registry is :mod:`orchestrator.slots.registry` with its members (residency, ownership, durability, sequences);
``orchestrator/check.py`` (``slotserve check``, which tests a fresh engine before any slot
exists) may erase its own test sequences.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from orchestrator.slots.model import Slot

ROOT = Path(__file__).resolve().parents[2]
SLOT_FIELDS = {f.name for f in dataclasses.fields(Slot)}
KV_OPERATIONS = {"seq_op", "restore", "restore_state", "save_state", "erase", "fork", "truncate", "context_shift"}
REGISTRY = {f"orchestrator/slots/{m}.py" for m in ("registry", "residency", "ownership", "durability", "sequences")}


def slot_writes(source: str) -> list[str]:
    """``target`` of every assignment to a Slot-field-named attribute of something other than ``self``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for el in target.elts if isinstance(target, ast.Tuple) else [target]:
                owner = el.value if isinstance(el, ast.Attribute) else None
                if (
                    owner is not None
                    and el.attr in SLOT_FIELDS
                    and not (isinstance(owner, ast.Name) and owner.id == "self")
                ):
                    out.append(ast.unparse(el))
    return out


def kv_calls(source: str) -> list[str]:
    """Every call ``<...engine>.<KV operation>(...)`` in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in KV_OPERATIONS:
            receiver = ast.unparse(node.func.value)
            if receiver.split(".")[-1] == "engine":
                out.append(f"{receiver}.{node.func.attr}")
    return out


def by_module(find: object) -> dict[str, list[str]]:
    """``find``'s hits per module of the orchestrator package (modules without hits left out)."""
    hits = {}
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        found = find(path.read_text())  # type: ignore[operator]
        if found:
            hits[path.relative_to(ROOT).as_posix()] = found
    return hits


def test_the_readers_see_writes_and_kv_calls() -> None:
    source = "slot.n_tokens = 3\ns.dirty, s.stored = True, False\nself.seq = 1\nx.requests += 1\n"
    assert slot_writes(source) == ["slot.n_tokens", "s.dirty", "s.stored", "x.requests"]
    calls = "await self.engine.seq_op('erase', 0)\nawait engine.fork(0, 1)\nawait store.delete(x)\n"
    assert kv_calls(calls) == ["self.engine.seq_op", "engine.fork"]


def test_only_the_registry_writes_slot_fields() -> None:
    writers = by_module(slot_writes)
    assert "orchestrator/slots/registry.py" in writers, "the reader found no writes at all"
    assert set(writers) <= REGISTRY, {m: w for m, w in writers.items() if m not in REGISTRY}


def test_only_the_registry_calls_kv_operations() -> None:
    callers = by_module(kv_calls)
    assert "orchestrator/slots/registry.py" in callers, "the reader found no KV calls at all"
    allowed = REGISTRY | {"orchestrator/check.py"}
    assert set(callers) <= allowed, {m: c for m, c in callers.items() if m not in allowed}
