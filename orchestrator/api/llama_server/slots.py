"""llama-server's slot API: paths, query actions, field names and content negotiation (docs/api.md, "Slots").

``POST /slots/{id}?action=...`` dispatches on a typed :class:`SlotAction` (the OpenAPI
schema lists the values; any other is a 400 from Litestar's parameter validation) to one
handler each, :data:`ACTIONS`.  Every route answers only its caller's tenant (its principal,
:func:`orchestrator.tenants.principal.principal_of`): ids are looked up in that tenant, so
another tenant's slot answers ``SLOT_NOT_FOUND`` exactly as a missing one; ``GET /slots`` lists
the caller's slots (an ``admin`` sees every tenant's, each entry naming its ``tenant``).  The slot
actions themselves are :class:`orchestrator.slots.operations.SlotOps`, provided by dependency
injection (``ops``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.openapi import ResponseSpec
from litestar.params import Parameter

from contract.errors import ErrorCode
from contract.framing import Buffer
from orchestrator.api.common.run import COMPAT_ERRORS, cancelled_on_disconnect
from orchestrator.api.common.wire import MessageSpan
from orchestrator.api.llama_server.protocol import (
    ContextShiftRequest,
    ContextShiftResponse,
    EraseResponse,
    ForkRequest,
    ForkResponse,
    RestoreFileResponse,
    RestoreStateRequest,
    RestoreStateResponse,
    RestoreTimings,
    SaveFileResponse,
    SaveStateResponse,
    SaveTimings,
    SlotAction,
    SlotActionResponse,
    SlotEntry,
    SlotFileRequest,
    SlotInfo,
    TokensResponse,
)
from orchestrator.api.llama_server.routes import check_slot_number, slot_task_fields
from orchestrator.generation.service import RunControl
from orchestrator.services import Services
from orchestrator.slots.model import slot_id_out, slot_key, split_key
from orchestrator.slots.operations import FileResult, SlotOps, message_boundaries
from orchestrator.slots.registry import Slot, check_slot_id
from orchestrator.tenants.keys import TENANT_NAME
from orchestrator.tenants.principal import DEFAULT_TENANT, principal_of
from orchestrator.web.auth import require_admin
from orchestrator.web.body import decode_json_body
from orchestrator.web.digest import check_repr_digest, repr_digest, wanted_digest
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError
from orchestrator.web.raw_body import BODY_POOL, BuffersResponse, lent_to_worker, read_body
from storage.base import state_bytes, stored_bytes

OCTET = "application/octet-stream"
MAX_STATE_BYTES = 4 << 30


def numbered_first(
    seen: dict[str, dict[str, Any]], n_parallel: int, n_ctx: int, tenant: str = DEFAULT_TENANT
) -> list[dict[str, Any]]:
    """``GET /slots`` in llama-server's order: the caller's (``tenant``'s) ``n_parallel`` numbered slots
    ``0..n_parallel-1`` always (llama-server's ``server_slot::to_json``: ``id``, ``n_ctx``,
    ``speculative``, ``is_processing``; an unused one is ``place: "empty"``), then every other slot in
    ``seen`` (by :func:`orchestrator.slots.model.slot_key`: slotserve's named conversations, numbers
    past ``n_parallel``, other tenants' for an admin), marked ``named: true``."""
    out = [
        seen.pop(slot_key(tenant, str(i)), {})
        or {
            "id": i,
            "tenant": tenant,
            "n_ctx": n_ctx,
            "speculative": False,
            "is_processing": False,
            "n_tokens": 0,
            "place": "empty",
            "stored_bytes": None,
            "state_bytes": None,
        }
        for i in range(n_parallel)
    ]
    return out + [{**entry, "named": True} for entry in seen.values()]


READ_ONLY_ACTIONS = (SlotAction.SAVE_STATE, SlotAction.TOKENS)  # every other action changes a slot: admin key


@dataclass
class ActionCall:
    """One ``POST /slots/{id}`` request as its action handler needs it."""

    request: Request[Any, Any, Any]
    services: Services
    ops: SlotOps
    slot_id: str
    wait: bool
    tenant: str = DEFAULT_TENANT  # the caller's: every slot it names is looked up there
    control: RunControl = field(default_factory=RunControl)  # its client's departure ends its waits

    @property
    def out_id(self) -> int | str:
        """The slot id as llama-server reports it (numeric ids as integers)."""
        return slot_id_out(self.slot_id)

    @asynccontextmanager
    async def use(self, slot_id: str | None = None, *, create: bool = False) -> AsyncIterator[Slot]:
        """Hold a slot (this request's by default) for the action; not restored until needed.

        Call it once the body has been read: from here the client is watched, and one that
        leaves while the action waits (``wait=true`` for a busy slot, or an engine sequence
        to restore into) ends it with ``CLIENT_GONE``, the slot untouched."""
        async with (
            cancelled_on_disconnect(self.request, self.control) as control,
            self.services.registry.use(
                slot_id or self.slot_id,
                tenant=self.tenant,
                create=create,
                resident=False,
                wait=self.wait,
                hooks=control.hooks,
            ) as slot,
        ):
            yield slot

    async def body(self, kind: type[Any]) -> Any:
        """The JSON body decoded strictly into ``kind`` (``INVALID_REQUEST`` otherwise)."""
        return decode_json_body(await self.request.body(), kind)

    async def is_new(self) -> bool:
        """True when the caller's tenant has the slot neither here nor in the store (a restore creates it)."""
        return not await self.services.registry.exists(self.slot_id, self.tenant)


async def _save_state(call: ActionCall) -> SaveStateResponse | BuffersResponse:
    raw = OCTET in call.request.headers.get("accept", "")
    algorithm = wanted_digest(call.request.headers.get("want-repr-digest")) if raw else None  # checked first
    async with AsyncExitStack() as loans:
        async with call.use() as slot:  # the slot is let go once its state is read: the loan outlives it
            saved = await loans.enter_async_context(call.ops.save_state(slot))
        chunks = saved.ses1_chunks()
        if raw:
            headers = {"X-Slot-Tokens": str(saved.n_tokens)}
            if algorithm is not None:  # hashed only when asked
                headers["Repr-Digest"] = await asyncio.to_thread(repr_digest, *chunks, algorithm=algorithm)
            return BuffersResponse(chunks, OCTET, headers, saved.hand_off())  # given back once sent
        digest = await asyncio.to_thread(repr_digest, *chunks)
        state = await asyncio.to_thread(_base64, chunks)  # tens of MB: off the event loop
    return SaveStateResponse(
        id_slot=call.out_id, n_tokens=saved.n_tokens, n_bytes=saved.ses1_size, t_ms=round(saved.t_ms, 3),
        state=state, digest=digest,
    )  # fmt: skip


async def _restore_state(call: ActionCall) -> RestoreStateResponse:
    with lent_to_worker(await read_body(call.request)) as raw:
        return await _restore_body(call, raw)


def _base64(chunks: Sequence[Buffer]) -> str:
    return base64.b64encode(b"".join(chunks)).decode("ascii")


def _restore_blob(raw: Buffer, digest_header: str | None, octets: bool) -> Buffer:
    """The SES1 blob of a ``restore-state`` body (``octets``: the body itself, else the JSON form's
    base64 ``state``), its digests checked.  Hashes and decodes up to gigabytes: call it in a thread.
    Raises ``ApiError`` (``INVALID_REQUEST``, ``BAD_STATE``)."""
    if digest_header is not None:
        check_repr_digest(digest_header, raw, "the request body")
    if octets:
        return raw
    body = decode_json_body(raw, RestoreStateRequest)
    try:
        blob = base64.b64decode(body.state, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(ErrorCode.BAD_STATE, f"state is not valid base64: {exc}") from exc
    if body.digest is not None:
        check_repr_digest(body.digest, blob, "the state")
    return blob


async def _restore_body(call: ActionCall, raw: Buffer) -> RestoreStateResponse:
    headers = call.request.headers
    octets = headers.get("content-type", "").startswith(OCTET)
    blob = await asyncio.to_thread(_restore_blob, raw, headers.get("repr-digest"), octets)
    created = await call.is_new()
    async with call.use(create=True) as slot:
        t_ms = await call.ops.restore_state(slot, blob, created)
    return RestoreStateResponse(id_slot=call.out_id, n_bytes_read=len(blob), success=True, t_ms=round(t_ms, 3))


async def _tokens(call: ActionCall) -> TokensResponse:
    async with call.use() as slot:
        tokens = await call.ops.tokens(slot)
        processed = slot.n_prompt_tokens_processed or len(tokens)
    return TokensResponse(id_slot=call.out_id, n_tokens=len(tokens), tokens=tokens, n_prompt_tokens_processed=processed)


async def _context_shift(call: ActionCall) -> ContextShiftResponse:
    body: ContextShiftRequest = await call.body(ContextShiftRequest)
    async with call.use() as slot:
        n = await call.ops.context_shift(slot, body.n_keep, body.n_discard)
    return ContextShiftResponse(id_slot=call.out_id, success=True, new_n_tokens=n)


async def _erase(call: ActionCall) -> EraseResponse:
    async with call.use() as slot:
        n = await call.ops.erase(slot)
        await call.services.registry.forget(slot)
    return EraseResponse(id_slot=call.out_id, n_erased=n)


async def _save(call: ActionCall) -> SaveFileResponse:
    body: SlotFileRequest = await call.body(SlotFileRequest)
    async with call.use() as slot:
        done = await call.ops.save_file(slot, body.filename)
    return SaveFileResponse(
        id_slot=call.out_id, filename=body.filename, n_saved=done.n_tokens, n_written=done.n_bytes,
        timings=SaveTimings(save_ms=round(done.t_ms, 3)),
    )  # fmt: skip


async def _restore(call: ActionCall) -> RestoreFileResponse:
    body: SlotFileRequest = await call.body(SlotFileRequest)
    if call.ops.worker_files:  # the worker reads the file
        path = await call.ops.saved_file(body.filename, call.tenant)
        created = await call.is_new()
        async with call.use(create=True) as slot:
            done = await call.ops.restore_file(slot, path, created)
    else:  # read here, sent to the worker
        t0 = time.perf_counter()
        parsed, buf, n_read = await call.ops.read_file(body.filename, BODY_POOL, call.tenant)
        read_ms = (time.perf_counter() - t0) * 1000
        with lent_to_worker(buf):
            created = await call.is_new()
            async with call.use(create=True) as slot:
                t0 = time.perf_counter()
                await call.ops.restore(slot, parsed.tokens, parsed.state, created)
                t_ms = read_ms + (time.perf_counter() - t0) * 1000
        done = FileResult(len(parsed.tokens), n_read, t_ms)
    return RestoreFileResponse(
        id_slot=call.out_id, filename=body.filename, n_restored=done.n_tokens, n_read=done.n_bytes,
        timings=RestoreTimings(restore_ms=round(done.t_ms, 3)),
    )  # fmt: skip


async def _fork(call: ActionCall) -> ForkResponse:
    body: ForkRequest = await call.body(ForkRequest)
    target = check_slot_id(str(body.target))
    if target == call.slot_id:
        raise ApiError(ErrorCode.INVALID_REQUEST, "fork target must differ from the source slot")
    async with call.use() as src, call.use(target, create=True) as dst:  # both in the caller's tenant
        n = await call.ops.fork(src, dst)
    return ForkResponse(id_slot=call.out_id, target=slot_id_out(target), n_tokens=n, success=True)


ACTIONS: dict[SlotAction, Callable[[ActionCall], Awaitable[SlotActionResponse | BuffersResponse]]] = {
    SlotAction.SAVE_STATE: _save_state,
    SlotAction.RESTORE_STATE: _restore_state,
    SlotAction.TOKENS: _tokens,
    SlotAction.CONTEXT_SHIFT: _context_shift,
    SlotAction.SAVE: _save,
    SlotAction.RESTORE: _restore,
    SlotAction.ERASE: _erase,
    SlotAction.FORK: _fork,
}
"""The handler of each slot action."""

ACTION_RESPONSES = {
    **COMPAT_ERROR_RESPONSES,
    200: ResponseSpec(
        SlotActionResponse,  # type: ignore[arg-type]
        description="the action's result (save-state with Accept: application/octet-stream: the raw SES1 bytes)",
        generate_examples=False,
    ),
}


def guard_slot_change(request: Request[Any, Any, Any], services: Services) -> None:
    """A slot-changing action (save, restore, erase, fork, context shift...) acts on the caller's own slots.
    With ``--api-keys`` each tenant manages its own; with one ``--api-key`` and ``--admin-key`` (one tenant
    shared by every key holder) the admin key guards them, as it did before tenants (docs/operations.md,
    "Tenants").  Raises ``UNAUTHORIZED`` (401)."""
    if services.settings.admin_key and not services.settings.api_keys:
        require_admin(request)


def acting_tenant(request: Request[Any, Any, Any], tenant: str | None) -> str:
    """The tenant whose slot an action addresses: the caller's own, or for an admin the ``tenant`` query
    parameter (the admin page acts on any tenant's slot; a bad tenant name is ``INVALID_REQUEST``).  A
    user naming another tenant is refused with ``UNAUTHORIZED`` whatever the tenant and slot, so the
    refusal reveals nothing of them."""
    principal = principal_of(request)
    if tenant is None or tenant == principal.tenant:
        return principal.tenant
    require_admin(request)
    if not TENANT_NAME.fullmatch(tenant):
        raise ApiError(ErrorCode.INVALID_REQUEST, "tenant: 1-64 characters of A-Z a-z 0-9 . _ -")
    return tenant


class SlotController(Controller):
    """``GET /slots``, ``POST /slots/{id}?action=...``, ``GET /v1/slots/{id}/info``.

    Errors have llama-server's shape, ``{"error": {"code", "message", "type"}, "error_code"}``.
    """

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @get("/slots", summary="The caller's slots: resident and parked, with sizes", responses=COMPAT_ERROR_RESPONSES)
    async def list_slots(self, request: Request[Any, Any, Any], services: Services) -> list[SlotEntry]:
        if not services.settings.slots_endpoint:
            raise ApiError(ErrorCode.NOT_SUPPORTED, "This server does not support slots endpoint (--no-slots)", 501)
        principal = principal_of(request)
        scope = None if principal.admin else principal.tenant  # an admin sees every tenant's
        reg = services.registry
        n_ctx = services.generation.info.n_ctx
        seen: dict[str, dict[str, Any]] = {}
        if services.archive is not None:
            for meta in await services.archive.list_stored():
                tenant, slot_id = split_key(meta.slot_id)
                if scope is not None and tenant != scope:
                    continue
                seen[meta.slot_id] = {
                    "id": slot_id_out(slot_id),
                    "tenant": tenant,
                    "n_ctx": n_ctx,
                    "is_processing": False,
                    "n_tokens": meta.n_tokens,
                    "place": "parked",
                    "stored_bytes": stored_bytes(meta),
                    "state_bytes": state_bytes(meta),
                    "codec": meta.codec,
                    "updated_at": meta.updated_at,
                }
        for slot in reg.of_tenant(scope):
            entry = seen.setdefault(slot.key, {"id": slot_id_out(slot.id), "tenant": slot.tenant, "n_ctx": n_ctx})
            entry.update(
                is_processing=slot.busy,
                n_tokens=slot.n_tokens,
                place="resident" if reg.is_resident(slot) else slot.place,
                seq=slot.seq if reg.is_resident(slot) else None,
                stored=slot.stored,
                dirty=slot.dirty,
                idle_s=round(time.monotonic() - slot.last_used, 3),
                **slot_task_fields(slot),
            )
            entry.setdefault("stored_bytes", slot.stored_bytes)
            entry.setdefault("state_bytes", slot.raw_bytes)
        n_parallel = services.settings.worker.engine.n_slots
        entries = numbered_first(seen, n_parallel, n_ctx, principal.tenant)
        return msgspec.convert(entries, list[SlotEntry])

    @get(
        "/v1/slots/{slot_id:str}/info",
        summary="Tokens and message boundaries at the end-of-turn token",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def info(self, request: Request[Any, Any, Any], services: Services, ops: SlotOps, slot_id: str) -> SlotInfo:
        eot = services.generation.info.eot_token_id
        tenant = principal_of(request).tenant
        async with services.registry.use(slot_id, tenant=tenant, create=False, resident=False) as slot:
            tokens = await ops.tokens(slot)
        msgs = [MessageSpan(**m) for m in message_boundaries(tokens, eot)]
        return SlotInfo(
            id_slot=slot_id_out(slot_id), n_tokens=len(tokens), boundary_eot=eot, n_messages=len(msgs), messages=msgs
        )

    @post(
        "/slots/{slot_id:str}",
        status_code=200,
        request_max_body_size=MAX_STATE_BYTES,
        summary="Slot actions (llama-server's, plus fork)",
        responses=ACTION_RESPONSES,
    )
    async def action(
        self,
        request: Request[Any, Any, Any],
        services: Services,
        ops: SlotOps,
        slot_id: str,
        action: SlotAction = Parameter(query="action"),
        wait: bool = Parameter(query="wait", default=False),
        tenant: str | None = Parameter(
            query="tenant", default=None, description="admin only: act on this tenant's slot (the admin page)"
        ),
    ) -> SlotActionResponse | BuffersResponse:
        check_slot_number(slot_id)
        if action not in READ_ONLY_ACTIONS:
            guard_slot_change(request, services)
        call = ActionCall(request, services, ops, check_slot_id(slot_id), wait, acting_tenant(request, tenant))
        return await ACTIONS[action](call)
