"""Ollama's API: ``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/chat``, ``/api/generate``,
``/api/embed`` and ``/api/embeddings`` (Ollama's ``docs/api.md``), on the generation service and slots every
API shares.

Streamed answers (``stream`` true, Ollama's default) are NDJSON (``application/x-ndjson``): one
:class:`ChatResponse` / :class:`GenerateResponse` per line, the last with ``done: true``; a failure after
the stream began is one last ``{"error": ..., "error_code": ...}`` line, as Ollama ends a stream.  Tool
calls come whole, in one line before the last (Ollama parses a call before sending it).  Errors before
an answer are Ollama's ``{"error": "<message>"}`` with ``error_code`` (the app's handlers); shaping:
:mod:`orchestrator.api.ollama.serving`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from contract.errors import ErrorCode
from orchestrator.api.common.run import collect, started_run
from orchestrator.api.ollama import serving
from orchestrator.api.ollama.protocol import (
    ChatRequest,
    ChatResponse,
    DoneReason,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbedRequest,
    EmbedResponse,
    GenerateRequest,
    GenerateResponse,
    ListModel,
    ListResponse,
    Message,
    ProcessResponse,
    RunningModel,
    ShowRequest,
    ShowResponse,
    VersionResponse,
)
from orchestrator.generation.answer_text import AnswerText
from orchestrator.generation.embeddings import normalized, pooled
from orchestrator.generation.events import DoneOut, TokenOut
from orchestrator.generation.pieces import Piece, ReasoningDelta
from orchestrator.services import Services
from orchestrator.web.errors import ERROR_RESPONSES, ApiError, report, route_of

NDJSON = "application/x-ndjson"
_json = msgspec.json.Encoder()


class NdjsonStream(Stream):
    """An ``application/x-ndjson`` response from a handler that may also answer JSON (the route's media type
    would otherwise win, as for :class:`orchestrator.web.sse.EventStream`)."""

    def __init__(self, content: Any) -> None:
        super().__init__(content, media_type=NDJSON, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = self.media_type
        return super().to_asgi_response(*args, **kwargs)


def line(obj: Any) -> bytes:
    """One NDJSON line."""
    return _json.encode(obj) + b"\n"


def streamable(body: type[msgspec.Struct]) -> dict[int, ResponseSpec]:
    """``responses=`` of a route answering ``body`` as JSON, or (``stream`` true) NDJSON lines of it."""
    spec = ResponseSpec(body, description=f"the answer; streamed: {NDJSON} lines of it", generate_examples=False)
    return {**ERROR_RESPONSES, 200: spec}


async def _lines(run: Any, request: Request[Any, Any, Any], shape: Any) -> AsyncIterator[bytes]:
    """The NDJSON lines of a streamed run: ``shape(event)`` per event, and an error line if the run fails."""
    try:
        async for ev in run:
            for out in shape(ev):
                yield line(out)
    except Exception as exc:  # the worker failed mid-stream: Ollama's error line ends the stream
        yield line(report(exc, route_of(request)).body())
    finally:
        await run.aclose()


class OllamaController(Controller):
    """Ollama's routes (errors in Ollama's ``{"error"}`` shape with ``error_code``)."""

    @get("/api/version", summary="Ollama: the API version", responses=ERROR_RESPONSES)
    async def version(self) -> VersionResponse:
        return VersionResponse(version=serving.OLLAMA_VERSION)

    @get("/api/tags", summary="Ollama: the served model", responses=ERROR_RESPONSES)
    async def list_models(self, services: Services) -> ListResponse:
        info = services.generation.info
        details, modified = serving.details(info), serving.modified_at(info)
        models = [
            ListModel(name=n, model=n, modified_at=modified, size=info.size_bytes, digest=info.fingerprint,
                      details=details)
            for n in serving.model_names(services)
        ]  # fmt: skip
        return ListResponse(models=models)

    @get("/api/ps", summary="Ollama: the loaded model", responses=ERROR_RESPONSES)
    async def ps(self, services: Services) -> ProcessResponse:
        info = services.generation.info
        name = serving.model_names(services)[0]
        offloaded = info.runtime.n_layers_offloaded / max(1, info.num_layers)
        running = RunningModel(
            name=name, model=name, size=info.size_bytes, digest=info.fingerprint, details=serving.details(info),
            expires_at=serving.NEVER, size_vram=int(info.size_bytes * min(1.0, offloaded)), context_length=info.n_ctx,
        )  # fmt: skip
        return ProcessResponse(models=[running])

    @post("/api/show", status_code=200, summary="Ollama: the model's details", responses=ERROR_RESPONSES)
    async def show(self, services: Services, data: ShowRequest) -> ShowResponse:
        serving.check_model(services, data.model or data.name)
        info = services.generation.info
        return ShowResponse(
            modelfile=f"# Modelfile of the model slotserve serves\nFROM {info.model_path}\n",
            parameters=serving.parameters(info), template=info.chat_template, details=serving.details(info),
            model_info=serving.model_info(info), capabilities=serving.capabilities(info),
            modified_at=serving.modified_at(info),
        )  # fmt: skip

    @post("/api/chat", status_code=200, summary="Ollama: the next chat message", responses=streamable(ChatResponse))
    async def chat(
        self, request: Request[Any, Any, Any], services: Services, data: ChatRequest
    ) -> NdjsonStream | ChatResponse:
        model = serving.check_model(services, data.model)
        serving.check_think(data.think, services.generation.info, model)
        keep = serving.keep_alive_s(data.keep_alive)
        if not data.messages:  # Ollama loads the model and answers at once
            reason: DoneReason = "unload" if keep == 0 else "load"
            return ChatResponse(model=model, created_at=serving.now(), message=Message(role="assistant", content=""),
                                done=True, done_reason=reason)  # fmt: skip
        ids, plan, prompt = await serving.chat_prompt(services, data.messages, data.tools, data.think)
        req = serving.canonical(services, request, ids, data.options, data.format)
        if plan is not None and plan.active:
            plan.constrain(req)
        else:
            plan = None
        text = AnswerText(req.stop_strings, plan.splitter() if plan else None,
                          serving.thinking_parser(services, data.think, prompt))  # fmt: skip
        then = serving.park_after(services, keep)
        if not data.stream:
            got = await collect(services, req, request, then=then)
            whole = text.whole([t.text for t in got.tokens if not t.is_stop], got.end.stop_string)
            return serving.chat_end(model, got.end, whole.content or "", serving.tool_calls(whole.calls),
                                    whole.reasoning)  # fmt: skip
        run = await started_run(services, req, request, then=then)
        return NdjsonStream(_lines(run, request, _chat_lines(model, text)))

    @post("/api/generate", status_code=200, summary="Ollama: a completion", responses=streamable(GenerateResponse))
    async def generate(
        self, request: Request[Any, Any, Any], services: Services, data: GenerateRequest
    ) -> NdjsonStream | GenerateResponse:
        model = serving.check_model(services, data.model)
        info = services.generation.info
        serving.check_think(data.think, info, model)
        keep = serving.keep_alive_s(data.keep_alive)
        if data.raw and (data.template or data.system or data.context):
            raise ApiError(ErrorCode.INVALID_REQUEST, "raw mode does not support template, system, or context")
        if data.template:
            raise ApiError(ErrorCode.INVALID_REQUEST, "template: not supported (the model's own chat template is used)")
        if data.suffix:
            raise ApiError(ErrorCode.INVALID_REQUEST, f'"{model}" does not support insert')
        if data.images:
            raise ApiError(ErrorCode.INVALID_REQUEST, "image input is not supported: this model reads text only")
        if not data.prompt:  # Ollama loads the model and answers at once
            return GenerateResponse(model=model, created_at=serving.now(), response="", done=True,
                                    done_reason="unload" if keep == 0 else "load")  # fmt: skip
        ids, prompt = await serving.generate_prompt(
            services, data.prompt, data.system, data.context, data.raw, data.think
        )
        req = serving.canonical(services, request, ids, data.options, data.format)
        text = AnswerText(
            req.stop_strings, None, None if data.raw else serving.thinking_parser(services, data.think, prompt)
        )
        then = serving.park_after(services, keep)
        if not data.stream:
            got = await collect(services, req, request, then=then)
            kept = [t for t in got.tokens if not t.is_stop]
            whole = text.whole([t.text for t in kept], got.end.stop_string)
            context = None if data.raw else ids + [t.token_id for t in kept]
            return serving.generate_end(model, got.end, whole.content or "", context, whole.reasoning)
        run = await started_run(services, req, request, then=then)
        return NdjsonStream(_lines(run, request, _generate_lines(model, text, None if data.raw else ids)))

    @post("/api/embed", status_code=200, summary="Ollama: embeddings of texts", responses=ERROR_RESPONSES)
    async def embed(self, services: Services, data: EmbedRequest) -> EmbedResponse:
        model = serving.check_model(services, data.model)
        texts = [data.input] if isinstance(data.input, str) else data.input
        if texts in ([""], []):  # Ollama loads the model and answers no vectors
            return EmbedResponse(model=model, embeddings=[], total_duration=0, load_duration=0, prompt_eval_count=0)
        if not all(texts):
            raise ApiError(ErrorCode.INVALID_REQUEST, "input texts must not be empty")
        t0 = serving.now_ns()
        rows, counts = await pooled(services.embedder, texts)
        if data.dimensions is not None:
            if data.dimensions > rows.shape[1]:
                raise ApiError(ErrorCode.INVALID_REQUEST, f"dimensions: at most {rows.shape[1]} for this model")
            rows = rows[:, : data.dimensions]
        vectors = normalized(rows).tolist()
        return EmbedResponse(model=model, embeddings=vectors, total_duration=serving.now_ns() - t0, load_duration=0,
                             prompt_eval_count=sum(counts))  # fmt: skip

    @post("/api/embeddings", status_code=200, summary="Ollama: one embedding (older route)", responses=ERROR_RESPONSES)
    async def embeddings(self, services: Services, data: EmbeddingRequest) -> EmbeddingResponse:
        serving.check_model(services, data.model)
        if not data.prompt:
            return EmbeddingResponse(embedding=[])
        rows, _ = await pooled(services.embedder, [data.prompt])
        return EmbeddingResponse(embedding=rows[0].astype(float).tolist())


def _said(pieces: list[Piece]) -> tuple[str, str]:
    """``(content, thinking)`` of a list of answer pieces (tool call pieces are read from the parser whole)."""
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))


def _chat_lines(model: str, text: AnswerText) -> Any:
    """The ``/api/chat`` lines of each event: content and thinking as they come, the tool calls whole before
    the last."""

    def shape(ev: Any) -> list[ChatResponse]:
        if isinstance(ev, TokenOut):
            if ev.is_stop:
                return []
            said, thought = _said(text.feed(ev.text))
            return [serving.chat_chunk(model, said, thinking=thought)] if said or thought else []
        if isinstance(ev, DoneOut):
            said, thought = _said(text.finish(ev.stop_string))
            out = [serving.chat_chunk(model, said, thinking=thought)] if said or thought else []
            if text.calls:
                out.append(serving.chat_chunk(model, "", serving.tool_calls(text.calls)))
            return [*out, serving.chat_end(model, ev)]
        return []

    return shape


def _generate_lines(model: str, text: AnswerText, prompt: list[int] | None) -> Any:
    """The ``/api/generate`` lines of each event; the last carries ``context`` (``prompt`` and the generated
    tokens; None: raw mode, no context)."""
    generated: list[int] = []

    def shape(ev: Any) -> list[GenerateResponse]:
        if isinstance(ev, TokenOut):
            if ev.is_stop:
                return []
            generated.append(ev.token_id)
            said, thought = _said(text.feed(ev.text))
            return [serving.generate_chunk(model, said, thought)] if said or thought else []
        if isinstance(ev, DoneOut):
            said, thought = _said(text.finish(ev.stop_string))
            out = [serving.generate_chunk(model, said, thought)] if said or thought else []
            context = None if prompt is None else prompt + generated
            return [*out, serving.generate_end(model, ev, "", context)]
        return []

    return shape
