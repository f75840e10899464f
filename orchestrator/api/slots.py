"""llama-server's slot API: paths, query actions, field names and content negotiation (docs/api.md, "Slots")."""

from __future__ import annotations

import base64
import binascii
import time
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import Parameter

from engine.errors import ErrorCode
from orchestrator.api.body import decode_json_body
from orchestrator.api.compat import COMPAT_ERRORS
from orchestrator.api.llama_server import check_slot_number, slot_task_fields
from orchestrator.auth import require_admin
from orchestrator.digest import check_repr_digest, repr_digest
from orchestrator.errors import COMPAT_ERROR_RESPONSES, ApiError
from orchestrator.schemas import ContextShiftRequest, ForkRequest, RestoreStateRequest, SlotFileRequest
from orchestrator.services import Services
from orchestrator.slot_ops import SlotOps, message_boundaries
from orchestrator.slots import check_slot_id
from orchestrator.wire import slot_id_out

OCTET = "application/octet-stream"
READ_ONLY_ACTIONS = ("save-state", "tokens")  # every other action changes a slot or writes a file: admin key
MAX_STATE_BYTES = 4 << 30


def _ops(services: Services) -> SlotOps:
    return SlotOps(services.registry, services.settings.slot_save_path)


class SlotController(Controller):
    """``GET /slots``, ``POST /slots/{id}?action=...``, ``GET /v1/slots/{id}/info``.

    Errors have llama-server's shape, ``{"error": {"code", "message", "type"}, "error_code"}``.
    """

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @get("/slots", summary="All slots: resident and parked, with sizes", responses=COMPAT_ERROR_RESPONSES)
    async def list_slots(self, services: Services) -> list[dict[str, Any]]:
        if not services.settings.slots_endpoint:
            raise ApiError(ErrorCode.NOT_SUPPORTED, "This server does not support slots endpoint (--no-slots)", 501)
        reg = services.registry
        n_ctx = services.generation.info.n_ctx
        seen: dict[str, dict[str, Any]] = {}
        if services.persistence is not None:
            for meta in await services.persistence.list_stored():
                seen[meta.slot_id] = {
                    "id": slot_id_out(meta.slot_id),
                    "n_ctx": n_ctx,
                    "is_processing": False,
                    "n_tokens": meta.n_tokens,
                    "place": "parked",
                    "stored_bytes": meta.stored_size,
                    "state_bytes": meta.raw_size,
                    "codec": meta.codec,
                    "updated_at": meta.updated_at,
                }
        for slot in reg.slots.values():
            entry = seen.setdefault(slot.id, {"id": slot_id_out(slot.id), "n_ctx": n_ctx})
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
        return list(seen.values())

    @get(
        "/v1/slots/{slot_id:str}/info",
        summary="Tokens and message boundaries at the end-of-turn token",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def info(self, services: Services, slot_id: str) -> dict[str, Any]:
        eot = services.generation.info.eot_token_id
        async with services.registry.use(slot_id, create=False, resident=False) as slot:
            tokens = await _ops(services).tokens(slot)
        msgs = message_boundaries(tokens, eot)
        return {
            "id_slot": slot_id_out(slot_id),
            "n_tokens": len(tokens),
            "boundary_eot": eot,
            "n_messages": len(msgs),
            "messages": msgs,
        }

    @post(
        "/slots/{slot_id:str}",
        status_code=200,
        request_max_body_size=MAX_STATE_BYTES,
        summary="Slot actions (llama-server's, plus fork)",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def action(
        self,
        request: Request[Any, Any, Any],
        services: Services,
        slot_id: str,
        action: str = Parameter(query="action"),
        wait: bool = Parameter(query="wait", default=False),
    ) -> Any:
        check_slot_number(slot_id)
        if action not in READ_ONLY_ACTIONS:
            require_admin(request.scope, services.settings.admin_key)
        ops = _ops(services)
        reg = services.registry
        out_id = slot_id_out(check_slot_id(slot_id))
        if action == "save-state":
            async with reg.use(slot_id, create=False, resident=False, wait=wait) as slot:
                saved = await ops.save_state(slot)
            digest = repr_digest(saved.blob)
            if OCTET in request.headers.get("accept", ""):
                headers = {"X-Slot-Tokens": str(len(saved.tokens)), "Repr-Digest": digest}
                return Response(saved.blob, media_type=OCTET, headers=headers)
            return {
                "id_slot": out_id,
                "n_tokens": len(saved.tokens),
                "n_bytes": len(saved.blob),
                "t_ms": round(saved.t_ms, 3),
                "state": base64.b64encode(saved.blob).decode("ascii"),
                "digest": digest,
            }
        if action == "restore-state":
            raw = await request.body()
            header = request.headers.get("repr-digest")
            if header is not None:
                check_repr_digest(header, raw, "the request body")
            if request.headers.get("content-type", "").startswith(OCTET):
                blob = raw
            else:
                body = decode_json_body(raw, RestoreStateRequest)
                try:
                    blob = base64.b64decode(body.state, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise ApiError(ErrorCode.BAD_STATE, f"state is not valid base64: {exc}") from exc
                if body.digest is not None:
                    check_repr_digest(body.digest, blob, "the state")
            created = reg.find(slot_id) is None and not await self._stored(services, slot_id)
            async with reg.use(slot_id, create=True, resident=False, wait=wait) as slot:
                t_ms = await ops.restore_state(slot, blob, created)
            return {"id_slot": out_id, "n_bytes_read": len(blob), "success": True, "t_ms": round(t_ms, 3)}
        if action == "tokens":
            async with reg.use(slot_id, create=False, resident=False, wait=wait) as slot:
                tokens = await ops.tokens(slot)
                processed = slot.n_prompt_tokens_processed or len(tokens)
            return {
                "id_slot": out_id,
                "n_tokens": len(tokens),
                "tokens": tokens,
                "n_prompt_tokens_processed": processed,
            }
        if action == "context-shift":
            body = decode_json_body(await request.body(), ContextShiftRequest)
            async with reg.use(slot_id, create=False, resident=False, wait=wait) as slot:
                n = await ops.context_shift(slot, body.n_keep, body.n_discard)
            return {"id_slot": out_id, "success": True, "new_n_tokens": n}
        if action == "erase":
            async with reg.use(slot_id, create=False, resident=False, wait=wait) as slot:
                n = await ops.erase(slot)
                await reg.forget(slot)
            return {"id_slot": out_id, "n_erased": n}
        if action == "save":
            body = decode_json_body(await request.body(), SlotFileRequest)
            async with reg.use(slot_id, create=False, resident=False, wait=wait) as slot:
                saved, n_written = await ops.save_file(slot, body.filename)
            return {
                "id_slot": out_id,
                "filename": body.filename,
                "n_saved": len(saved.tokens),
                "n_written": n_written,
                "timings": {"save_ms": round(saved.t_ms, 3)},
            }
        if action == "restore":
            body = decode_json_body(await request.body(), SlotFileRequest)
            blob, n_read = ops.read_file(body.filename)
            created = reg.find(slot_id) is None and not await self._stored(services, slot_id)
            async with reg.use(slot_id, create=True, resident=False, wait=wait) as slot:
                t_ms = await ops.restore_state(slot, blob, created)
            return {
                "id_slot": out_id,
                "filename": body.filename,
                "n_restored": slot.n_tokens,
                "n_read": n_read,
                "timings": {"restore_ms": round(t_ms, 3)},
            }
        if action == "fork":
            body = decode_json_body(await request.body(), ForkRequest)
            target = str(body.target)
            if target == slot_id:
                raise ApiError(ErrorCode.INVALID_REQUEST, "fork target must differ from the source slot")
            async with (
                reg.use(slot_id, create=False, resident=False, wait=wait) as src,
                reg.use(target, create=True, resident=False, wait=wait) as dst,
            ):
                n = await ops.fork(src, dst)
            return {"id_slot": out_id, "target": slot_id_out(target), "n_tokens": n, "success": True}
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"unknown action {action!r}: save-state, restore-state, tokens, context-shift, save, restore, erase, fork",
        )

    @staticmethod
    async def _stored(services: Services, slot_id: str) -> bool:
        if services.persistence is None:
            return False
        return await services.persistence.lookup(slot_id) is not None
