"""Requests that name no slot: the slot whose cache shares the longest prefix with the prompt.

llama-server picks a slot for a request without ``id_slot`` by the similarity of its prompt to
each idle slot's tokens: the longest common prefix over the prompt's length, above
``--slot-prompt-similarity`` (default 0.1; ``tools/server/server-context.cpp``,
``get_available_slot``).  slotserve does the same over every slot it knows (resident, parked
on this node, or only in the store), with two differences that follow from keeping
conversations (docs/api.md, "Requests without a slot id"):

* a *named* slot (one a client created by naming it) is never overwritten: it is forked
  copy-on-write into a new anonymous slot (``llama_memory_seq_cp``), so a shared system prompt
  is prefilled once for everyone;
* an *anonymous* slot (id ``anon-<16 hex digits>``) is taken over only when the request
  continues its conversation (:func:`continues`: it keeps the slot's tokens, or, pruned in its
  middle, still holds most of them); one that only shares a prefix with the request
  (another client's conversation under the same system prompt) is forked like a named slot and
  left as it was.  llama-server instead overwrites it, saving it to its prompt cache first when
  the request keeps less than half of it.

With no slot above the threshold a new, empty anonymous slot is made.  Anonymous slots are
parked and expire like any other; at most ``max_slots`` of them are kept by a node: making one
more deletes the least recently used idle one (its stored copy too).  A similarity of 0 turns
matching off: requests without a slot id use slot ``"0"``, as before.
"""

from __future__ import annotations

import secrets
import time
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import structlog

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import WaitHooks
from orchestrator.slots.model import Slot
from orchestrator.slots.registry import SlotRegistry

log = structlog.get_logger("slotserve.anonymous")

ANON_PREFIX = "anon-"
DEFAULT_SLOT = "0"
TAIL = 16  # tokens of a run of a slot that a pruned prompt continuing it still holds
WINDOWS = 32  # runs of a slot looked for in a prompt
TAIL_SLACK = 8  # trailing tokens of a slot a continuing prompt may lack (re-tokenized text)
MAX_TRIES = 3  # a chosen slot taken by another request meanwhile: choose again


def is_anonymous(slot_id: str) -> bool:
    """True for the ids of slots made for requests without a slot id (``anon-...``)."""
    return slot_id.startswith(ANON_PREFIX)


def new_anonymous_id() -> str:
    """A fresh anonymous slot id: ``anon-`` + 16 random hex digits (unique across nodes)."""
    return ANON_PREFIX + secrets.token_hex(8)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (slice comparisons, bisected)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Candidate:
    """An idle slot and its tokens (a snapshot: the slot may change once its lock is taken)."""

    slot_id: str
    tokens: list[int]
    resident: bool


def _bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def contains(hay: bytes, needle: Sequence[int]) -> bool:
    """True when ``needle`` occurs as a contiguous run in the tokens ``hay`` (:func:`_bytes`: int64s)."""
    n = _bytes(needle)
    i = hay.find(n)
    while i != -1 and i % 8:
        i = hay.find(n, i + 1)
    return i != -1


def continues(tokens: Sequence[int], ids: Sequence[int], lcp: int) -> bool:
    """Whether prompt ``ids`` continues the conversation a slot's ``tokens`` hold, sharing ``lcp``
    tokens with it as a prefix.  Either it keeps all of them but at most :data:`TAIL_SLACK` (a
    re-tokenized or trimmed end) and at least half; or, pruned in its middle or trimmed at its
    front, it still holds at least half of the slot's tokens after the prefix, its latest ones
    among them: of up to :data:`WINDOWS` runs of :data:`TAIL` tokens taken evenly from them, half
    or more occur in the prompt after the prefix (what cache reuse can move into place), one of
    the last quarter among them.  Another client's prompt that only shares a prefix (a system
    prompt, a first message), or the same long text after another beginning, lacks the slot's
    latest turns."""
    rest = len(tokens) - lcp
    if rest <= TAIL_SLACK:
        return 2 * lcp >= len(tokens)
    if rest < TAIL:
        return False
    hay = _bytes(ids[lcp:])
    stride = max(TAIL, rest // WINDOWS)
    found = [contains(hay, tokens[i : i + TAIL]) for i in range(lcp, len(tokens) - TAIL + 1, stride)]
    latest = found[-max(1, len(found) // 4) :]  # the conversation's latest quarter: its own turns
    return 2 * sum(found) >= len(found) and any(latest)


@dataclass(frozen=True)
class Pick:
    """The chosen slot: ``lcp`` tokens shared with the prompt, ``similarity`` = lcp / len(prompt);
    ``take_over``: the request continues this anonymous slot (else the slot is forked)."""

    slot_id: str
    lcp: int
    similarity: float
    take_over: bool


def pick(ids: Sequence[int], candidates: Sequence[Candidate], threshold: float) -> Pick | None:
    """The slot for prompt ``ids``, or None.  An anonymous slot the prompt :func:`continues` comes
    first, whatever its similarity (a context pruned early shares little prefix, but cache reuse
    can still move its kept chunks into place); else the highest similarity above ``threshold``
    (llama-server's rule; ties: the fewest tokens beyond the shared prefix, then resident first)."""
    best: tuple[tuple[bool, int, int, bool], Pick] | None = None
    for c in candidates:
        if not c.tokens:
            continue
        lcp = common_prefix(c.tokens, ids)
        sim = lcp / len(ids)
        take = is_anonymous(c.slot_id) and continues(c.tokens, ids, lcp)
        if sim <= threshold and not take:
            continue
        key = (take, lcp, -len(c.tokens), c.resident)
        if best is None or key > best[0]:
            best = (key, Pick(c.slot_id, lcp, sim, take))
    return None if best is None else best[1]


class AnonymousSlots:
    """Chooses and holds the slot of a request without a slot id (see the module docstring).

    ``similarity``: llama-server's ``--slot-prompt-similarity`` (0: off, slot ``"0"``);
    ``max_slots``: anonymous slots a node keeps (``--anon-slots``).  :attr:`last` is the slot the
    latest such request used (a preview naming no slot forks it).
    """

    def __init__(self, registry: SlotRegistry, similarity: float = 0.1, max_slots: int = 64) -> None:
        self.registry = registry
        self.similarity = similarity
        self.max_slots = max_slots
        self.last: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether requests without a slot id are matched (else they use slot ``"0"``)."""
        return self.similarity > 0

    async def candidates(self) -> list[Candidate]:
        """Every idle slot with tokens: this node's (resident ones read from the engine) and the
        store's (their metadata keeps their tokens: no state is loaded to know them).  Busy slots
        are skipped, as llama-server skips processing slots."""
        reg = self.registry
        out: list[Candidate] = []
        seen: set[str] = set()
        for slot in list(reg.slots.values()):
            if slot.busy:
                seen.add(slot.id)
            elif reg.is_resident(slot):
                seen.add(slot.id)
                tokens = await reg.peek_tokens(slot)
                if tokens is not None:
                    out.append(Candidate(slot.id, tokens, True))
        if reg.archive is not None:
            try:
                fingerprint = reg.archive.fingerprint()
            except ServiceError:
                return out
            for meta in await reg.archive.list_stored():
                if meta.slot_id not in seen and meta.model_fingerprint == fingerprint:
                    out.append(Candidate(meta.slot_id, meta.tokens, False))
        return out

    @asynccontextmanager
    async def use(
        self,
        ids: Sequence[int],
        *,
        hooks: WaitHooks | None = None,
        reuse_cache: bool = True,
        on_chosen: Callable[[str], None] | None = None,
    ) -> AsyncIterator[Slot]:
        """Hold the slot for prompt ``ids`` (resident), as :meth:`SlotRegistry.use` does: the best
        match taken over, a fork of it, or a new anonymous slot (``reuse_cache`` False: always a
        new one, as llama-server's ``cache_prompt: false``).  ``on_chosen(slot_id)`` hears the
        choice before any wait for an engine sequence.  Raises what ``SlotRegistry.use`` raises
        (``RATE_LIMITED`` when no engine sequence comes free, ``CLIENT_GONE``...)."""
        chosen = on_chosen or (lambda _: None)
        if not self.enabled:
            chosen(DEFAULT_SLOT)
            async with self.registry.use(DEFAULT_SLOT, wait=True, hooks=hooks) as slot:
                yield slot
            return
        async with AsyncExitStack() as stack:
            slot = await self._enter(stack, ids, hooks, reuse_cache, chosen)
            self.last = slot.id
            yield slot

    async def _enter(
        self,
        stack: AsyncExitStack,
        ids: Sequence[int],
        hooks: WaitHooks | None,
        reuse_cache: bool,
        on_chosen: Callable[[str], None],
    ) -> Slot:
        """Choose the slot and enter its hold on ``stack`` (see :meth:`use`)."""
        tried: set[str] = set()
        chosen: Pick | None = None
        for _ in range(MAX_TRIES):
            found = [c for c in await self.candidates() if c.slot_id not in tried] if reuse_cache else []
            chosen = pick(ids, found, self.similarity)
            if chosen is None or not chosen.take_over:
                break
            on_chosen(chosen.slot_id)
            try:
                # not waited for: a slot another request took since it was seen idle is not this one's
                slot = await stack.enter_async_context(
                    self.registry.use(chosen.slot_id, wait=False, create=False, hooks=hooks)
                )
            except ServiceError as exc:
                if exc.code not in (ErrorCode.SLOT_BUSY, ErrorCode.SLOT_NOT_FOUND):
                    raise
                tried.add(chosen.slot_id)  # taken, deleted, or another node's: choose again
                chosen = None
                continue
            log.info("anonymous request continues its slot", slot_id=slot.id, lcp=chosen.lcp)
            return slot
        await self._make_room()
        new_id = new_anonymous_id()
        on_chosen(new_id)
        slot = await stack.enter_async_context(self.registry.use(new_id, create=True, resident=False, hooks=hooks))
        if chosen is not None:
            await self._fork(chosen, slot)
        else:
            log.info("anonymous request gets a new slot", slot_id=slot.id)
        await self.registry.ensure_resident(slot)
        return slot

    async def _fork(self, chosen: Pick, dst: Slot) -> None:
        """Make the new slot ``dst`` a copy-on-write copy of the chosen slot; a source taken by
        another request (or another node) meanwhile leaves ``dst`` empty (the prompt is then
        prefilled in full)."""
        try:
            async with self.registry.use(chosen.slot_id, wait=False, create=False, resident=False) as src:
                n = await self.registry.fork(src, dst)
        except ServiceError as exc:
            if exc.code not in (ErrorCode.SLOT_BUSY, ErrorCode.SLOT_NOT_FOUND, ErrorCode.NO_CACHED_CONTEXT):
                raise
            log.info("anonymous request: could not fork the matching slot", source=chosen.slot_id, error=exc.message)
            return
        log.info("anonymous request forks a slot", slot_id=dst.id, source=chosen.slot_id, lcp=chosen.lcp, n_tokens=n)

    async def _make_room(self) -> None:
        """Before a new anonymous slot: delete the least recently used idle anonymous ones while
        this node keeps ``max_slots`` of them, or (no store to park in) while no engine sequence
        is free."""
        reg = self.registry
        while True:
            anon = [s for s in reg.slots.values() if is_anonymous(s.id)]
            no_seq = reg.archive is None and all(s is not None and reg.is_resident(s) for s in reg.owner)
            if len(anon) < self.max_slots and not no_seq:
                return
            idle = [s for s in anon if not s.busy and not s.lock.locked()]
            if not idle:
                return
            victim = min(idle, key=lambda s: s.last_used)
            await reg.delete(victim)
            idle_s = time.monotonic() - victim.last_used
            log.info("anonymous slot deleted to make room", slot_id=victim.id, idle_s=idle_s)
