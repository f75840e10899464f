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
  continues its conversation (:func:`continues`: it keeps the slot's tokens; or all of them but
  the model's latest answer, which an agent sends back rewritten before its next message; or,
  pruned in its middle, it still holds most of them); one that only shares a prefix with the request
  (another client's conversation under the same system prompt) is forked like a named slot and
  left as it was.  llama-server instead overwrites it, saving it to its prompt cache first when
  the request keeps less than half of it.

With no slot above the threshold a new, empty anonymous slot is made.  Anonymous slots are
parked and expire like any other; at most ``max_slots`` of them per tenant are kept by a node:
making one more deletes the tenant's least recently used idle one (its stored copy too).  A
similarity of 0 turns matching off: requests without a slot id use slot ``"0"``, as before.

Every look-up is scoped: only the caller's tenant's slots of the same cache partition (its
``cache_salt``, :func:`orchestrator.slots.model.partition_of`) are candidates, taken over, forked
or deleted to make room; another tenant's slots are never seen.  A request that sends a
conversation key (``prompt_cache_key``, ``metadata.user_id``, a session header: docs/api.md) and
no slot id uses the slot that key names in its tenant and partition (:func:`keyed_id`), before
any prefix pick.  A slot whose park or save is in progress is waited for, not passed over, so a
conversation's next turn continues on its own slot.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from array import array
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import structlog

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError
from orchestrator.slots.admission import WaitHooks
from orchestrator.slots.model import Slot, split_key
from orchestrator.slots.registry import SlotRegistry
from orchestrator.tenants.principal import DEFAULT_TENANT

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


def keyed_id(partition: str, conversation_key: str) -> str:
    """The anonymous slot id a conversation key names within a tenant's cache ``partition``: ``anon-``
    and 16 hex digits of a SHA-256 over both (so the key is never shown, and every node finds it)."""
    digest = hashlib.sha256(f"{partition}\x00{conversation_key}".encode()).hexdigest()
    return ANON_PREFIX + digest[:16]


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


def rewrites_answer(tokens: Sequence[int], ids: Sequence[int], lcp: int, eog: Collection[int]) -> bool:
    """Whether prompt ``ids`` keeps every message of a slot's ``tokens`` but the latest and goes on
    past it: the slot's tokens after the ``lcp`` shared ones hold no end-of-generation token (``eog``:
    the model's ``eog_token_ids``, which end each chat message) but a last one, the slot holds at
    least one earlier message, and the prompt's own tokens after ``lcp`` close a message and add
    more.  That is an agent's next step: the model's answer (a tool call, its reasoning) comes back
    re-rendered by the client (smolagents writes a tool call as ``Calling tools:\n[{...}]`` text,
    OpenAI clients send ``tool_calls`` the chat template renders its own way), followed by the
    tool's result.  A regenerated answer (the prompt ends where the answer began) is not one;
    another conversation sharing a system prompt or a first question parts before the slot's
    latest message."""
    ends = frozenset(eog)
    if not ends or lcp >= len(tokens) or any(t in ends for t in tokens[lcp:-1]):
        return False
    return any(t in ends for t in ids[lcp:]) and any(t in ends for t in reversed(tokens[:lcp]))


def continues(tokens: Sequence[int], ids: Sequence[int], lcp: int, eog: Collection[int] = ()) -> bool:
    """Whether prompt ``ids`` continues the conversation a slot's ``tokens`` hold, sharing ``lcp``
    tokens with it as a prefix.  Either it keeps all of them but at most :data:`TAIL_SLACK` (a
    re-tokenized or trimmed end) and at least half; or it keeps all of them but the latest message,
    the model's answer, which the client sent back rewritten before its next message
    (:func:`rewrites_answer`, ``eog``: the end-of-generation token ids); or, pruned in its middle
    or trimmed at its front, it still holds at least half of the slot's tokens after the prefix,
    its latest ones among them: of up to :data:`WINDOWS` runs of :data:`TAIL` tokens taken evenly
    from them, half or more occur in the prompt after the prefix (what cache reuse can move into
    place), one of the last quarter among them.  Another client's prompt that only shares a prefix
    (a system prompt, a first message), or the same long text after another beginning, lacks the
    slot's latest turns."""
    if rewrites_answer(tokens, ids, lcp, eog):
        return True
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


def pick(
    ids: Sequence[int], candidates: Sequence[Candidate], threshold: float, eog: Collection[int] = ()
) -> Pick | None:
    """The slot for prompt ``ids``, or None (``eog``: the model's end-of-generation token ids, for
    :func:`continues`).  An anonymous slot the prompt :func:`continues` comes first, whatever its
    similarity (a context pruned early shares little prefix, but cache reuse
    can still move its kept chunks into place); else the highest similarity above ``threshold``
    (llama-server's rule; ties: the fewest tokens beyond the shared prefix, then resident first)."""
    best: tuple[tuple[bool, int, int, bool], Pick] | None = None
    for c in candidates:
        if not c.tokens:
            continue
        lcp = common_prefix(c.tokens, ids)
        sim = lcp / len(ids)
        take = is_anonymous(c.slot_id) and continues(c.tokens, ids, lcp, eog)
        if sim <= threshold and not take:
            continue
        key = (take, lcp, -len(c.tokens), c.resident)
        if best is None or key > best[0]:
            best = (key, Pick(c.slot_id, lcp, sim, take))
    return None if best is None else best[1]


class AnonymousSlots:
    """Chooses and holds the slot of a request without a slot id (see the module docstring).

    ``similarity``: llama-server's ``--slot-prompt-similarity`` (0: off, slot ``"0"``);
    ``max_slots``: anonymous slots a node keeps per tenant (``--anon-slots``).  :meth:`last` is the
    slot the latest such request of a tenant and partition used (a preview naming no slot forks it).
    """

    def __init__(self, registry: SlotRegistry, similarity: float = 0.1, max_slots: int = 64) -> None:
        self.registry = registry
        self.similarity = similarity
        self.max_slots = max_slots
        self._last: dict[tuple[str, str], str] = {}

    def last(self, tenant: str = DEFAULT_TENANT, partition: str = "") -> str | None:
        """The slot id the latest request without one of ``tenant`` in ``partition`` used, or None."""
        return self._last.get((tenant, partition))

    @property
    def enabled(self) -> bool:
        """Whether requests without a slot id are matched (else they use slot ``"0"``)."""
        return self.similarity > 0

    async def candidates(self, tenant: str = DEFAULT_TENANT, partition: str = "") -> list[Candidate]:
        """Every idle slot with tokens of ``tenant`` in cache ``partition``: this node's (resident ones
        read from the engine) and the store's (their metadata keeps their tokens: no state is loaded
        to know them).  Busy slots are skipped, as llama-server skips processing slots; one that a
        park or a save holds right now is waited for (it is still idle: its conversation may be the
        one asking)."""
        reg = self.registry
        out: list[Candidate] = []
        seen: set[str] = set()
        for slot in reg.of_tenant(tenant):
            if slot.partition != partition:
                seen.add(slot.id)
                continue
            if not slot.busy and slot.lock.locked():
                async with slot.lock:  # a park or a background save: over within one state write
                    pass
            if slot.busy:
                seen.add(slot.id)
            elif reg.is_resident(slot):
                seen.add(slot.id)
                tokens = await reg.kv.peek_tokens(slot)
                if tokens is not None:
                    out.append(Candidate(slot.id, tokens, True))
        if reg.archive is not None:
            try:
                fingerprint = reg.archive.fingerprint()
            except ServiceError:
                return out
            for meta in await reg.archive.list_stored():
                owner, slot_id = split_key(meta.slot_id)
                if (
                    owner == tenant
                    and meta.partition == partition
                    and slot_id not in seen
                    and meta.model_fingerprint == fingerprint
                ):
                    out.append(Candidate(slot_id, meta.tokens, False))
        return out

    @asynccontextmanager
    async def use(
        self,
        ids: Sequence[int],
        *,
        tenant: str = DEFAULT_TENANT,
        partition: str = "",
        conversation_key: str | None = None,
        hooks: WaitHooks | None = None,
        reuse_cache: bool = True,
        on_chosen: Callable[[str], None] | None = None,
        eog: Collection[int] = (),
    ) -> AsyncIterator[Slot]:
        """Hold ``tenant``'s slot for prompt ``ids`` (resident) in cache ``partition``, as
        :meth:`SlotRegistry.use` does: the slot ``conversation_key`` names (waited for while busy),
        else the best match taken over, a fork of it, or a new anonymous slot (``reuse_cache``
        False: always a new one, as llama-server's ``cache_prompt: false``).  ``on_chosen(slot_id)``
        hears the choice before any wait for an engine sequence; ``eog``: the model's
        end-of-generation token ids (:func:`continues`).  Raises what ``SlotRegistry.use``
        raises (``RATE_LIMITED`` when no engine sequence comes free, ``CLIENT_GONE``...)."""
        chosen = on_chosen or (lambda _: None)
        fixed = keyed_id(partition, conversation_key) if conversation_key else None
        if fixed is None and not self.enabled:
            fixed = DEFAULT_SLOT
        if fixed is not None:
            chosen(fixed)
            async with self.registry.use(fixed, tenant=tenant, partition=partition, wait=True, hooks=hooks) as slot:
                self._last[tenant, partition] = slot.id
                yield slot
            return
        async with AsyncExitStack() as stack:
            slot = await self._enter(stack, ids, tenant, partition, hooks, reuse_cache, chosen, eog)
            self._last[tenant, partition] = slot.id
            yield slot

    async def _enter(
        self,
        stack: AsyncExitStack,
        ids: Sequence[int],
        tenant: str,
        partition: str,
        hooks: WaitHooks | None,
        reuse_cache: bool,
        on_chosen: Callable[[str], None],
        eog: Collection[int] = (),
    ) -> Slot:
        """Choose the slot and enter its hold on ``stack`` (see :meth:`use`)."""
        tried: set[str] = set()
        chosen: Pick | None = None
        for _ in range(MAX_TRIES):
            found = await self.candidates(tenant, partition) if reuse_cache else []
            found = [c for c in found if c.slot_id not in tried]
            chosen = pick(ids, found, self.similarity, eog)
            if chosen is None or not chosen.take_over:
                break
            on_chosen(chosen.slot_id)
            try:
                # not waited for: a slot another request took since it was seen idle is not this one's
                slot = await stack.enter_async_context(
                    self.registry.use(chosen.slot_id, tenant=tenant, wait=False, create=False, hooks=hooks)
                )
            except ServiceError as exc:
                if exc.code not in (ErrorCode.SLOT_BUSY, ErrorCode.SLOT_NOT_FOUND):
                    raise
                tried.add(chosen.slot_id)  # taken, deleted, or another node's: choose again
                chosen = None
                continue
            log.info("anonymous request continues its slot", slot_id=slot.id, lcp=chosen.lcp)
            return slot
        await self._make_room(tenant)
        new_id = new_anonymous_id()
        on_chosen(new_id)
        slot = await stack.enter_async_context(
            self.registry.use(new_id, tenant=tenant, partition=partition, create=True, resident=False, hooks=hooks)
        )
        if chosen is not None:
            await self._fork(chosen, slot, tenant)
        else:
            log.info("anonymous request gets a new slot", slot_id=slot.id)
        await self.registry.ensure_resident(slot)
        return slot

    async def _fork(self, chosen: Pick, dst: Slot, tenant: str) -> None:
        """Make the new slot ``dst`` a copy-on-write copy of the chosen slot; a source taken by
        another request (or another node) meanwhile leaves ``dst`` empty (the prompt is then
        prefilled in full)."""
        try:
            async with self.registry.use(
                chosen.slot_id, tenant=tenant, wait=False, create=False, resident=False
            ) as src:
                n = await self.registry.kv.fork(src, dst)
        except ServiceError as exc:
            if exc.code not in (ErrorCode.SLOT_BUSY, ErrorCode.SLOT_NOT_FOUND, ErrorCode.NO_CACHED_CONTEXT):
                raise
            log.info("anonymous request: could not fork the matching slot", source=chosen.slot_id, error=exc.message)
            return
        log.info("anonymous request forks a slot", slot_id=dst.id, source=chosen.slot_id, lcp=chosen.lcp, n_tokens=n)

    async def _make_room(self, tenant: str) -> None:
        """Before a new anonymous slot of ``tenant``: delete the tenant's least recently used idle
        anonymous ones while this node keeps ``max_slots`` of them, or (no store to park in) while
        no engine sequence is free.  Another tenant's slots are never deleted for it.  A slot a park or
        a save holds right now is still idle: its deletion waits for it (``SlotRegistry.delete`` takes the
        lock); one that could not be deleted (taken meanwhile, its stored copy out of reach) is passed over."""
        reg = self.registry
        passed: set[str] = set()
        while True:
            anon = [s for s in reg.of_tenant(tenant) if is_anonymous(s.id)]
            no_seq = reg.archive is None and all(s is not None and reg.is_resident(s) for s in reg.residency.owner)
            if len(anon) < self.max_slots and not no_seq:
                return
            idle = [s for s in anon if not s.busy and s.id not in passed]
            if not idle:
                return
            victim = min(idle, key=lambda s: s.last_used)
            if not await reg.delete(victim):
                passed.add(victim.id)
                continue
            idle_s = time.monotonic() - victim.last_used
            log.info("anonymous slot deleted to make room", slot_id=victim.id, idle_s=idle_s)
