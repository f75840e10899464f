"""One decoder for every JSON request body, HTTP and WebSocket alike.

Bodies are decoded strictly (msgspec's default: ``"10"`` is not an integer) against
the Structs of :mod:`orchestrator.schemas`, whose value ranges are checked on the way.
Litestar converts a handler's ``data`` leniently (``strict=False``, meant for query
strings and forms), so the HTTP handlers take their body through :class:`StrictJson`,
a DTO that decodes with :func:`decode_json_body`; the WebSocket handlers and the slot
actions call :func:`decode_json_body` themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from litestar.dto import MsgspecDTO
from litestar.typing import FieldDefinition

from contract.errors import ErrorCode
from orchestrator.web.errors import ERROR_RESPONSES, ApiError

if TYPE_CHECKING:
    from litestar._openapi.schema_generation import SchemaCreator
    from litestar.openapi.spec import Reference, Schema

T = TypeVar("T")


def decode_json_body(raw: bytes | bytearray | memoryview | str, kind: type[T]) -> T:
    """``raw`` JSON decoded into ``kind`` (an empty body is ``{}``).

    Raises ``ApiError(ErrorCode.INVALID_REQUEST)`` for malformed JSON, text that is not UTF-8,
    a field of the wrong type or a value out of range.
    """
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"invalid request: {exc}") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"malformed JSON: {exc}") from exc


class StrictJson(MsgspecDTO[T]):  # type: ignore[type-var]
    """``dto=StrictJson[Model]``: the handler's ``data`` decoded by :func:`decode_json_body`."""

    def decode_bytes(self, value: bytes) -> Any:
        return decode_json_body(value, self.model_type)

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: SchemaCreator
    ) -> Reference | Schema:
        """The schema of the model itself (its fields and value ranges), not of a DTO transfer type."""
        return schema_creator.for_field_definition(FieldDefinition.from_annotation(cls.model_type))


def json_route(model: type[Any], responses: dict[int, Any] = ERROR_RESPONSES) -> dict[str, Any]:
    """Options of a route whose ``data`` is a ``model`` body: :class:`StrictJson`, documented errors
    (``responses``: :data:`orchestrator.web.errors.ERROR_RESPONSES`, or ``COMPAT_ERROR_RESPONSES`` on
    llama-server's and OpenAI's paths)."""
    return {"dto": StrictJson[model], "return_dto": None, "responses": responses}  # type: ignore[valid-type]
