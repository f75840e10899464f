"""Ollama's API as slotserve serves it: every request, response and stream chunk.

Field names and meanings are Ollama's (``docs/api.md`` and ``api/types.go`` of ollama/ollama): a
streamed answer is NDJSON, one :class:`ChatResponse` / :class:`GenerateResponse` object per line,
the last with ``done: true`` and the metrics; durations are nanoseconds (``int``); times are RFC 3339
strings.  ``options`` are Ollama's Modelfile parameters (:class:`Options`); keys this server does not
read (the runner's ``num_ctx``, ``num_gpu``... and unknown ones) are ignored, as Ollama ignores an
unknown option, while a known option of the wrong type is refused.  Errors are Ollama's
``{"error": "<message>"}`` with slotserve's ``error_code`` (:class:`orchestrator.web.errors.ErrorBody`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.generation.request import (
    Float32,
    Mirostat,
    NonNegFloat32,
    Probability,
    RepeatLastN,
    Seed,
    TopK,
)

ThinkLevel = Literal["low", "medium", "high", "max"]
Think = bool | ThinkLevel
"""``think``: a boolean, or a thinking level (Ollama's ``ThinkValue``)."""

KeepAlive = Annotated[
    float | str,
    msgspec.Meta(description="seconds, or a Go duration ('5m', '1h30m', '0'); negative: keep forever"),
]
"""``keep_alive`` (Ollama's ``Duration``): a number of seconds or a Go duration string."""

Format = Annotated[
    str | dict[str, Any], msgspec.Meta(description="'json' (any JSON object) or a JSON schema the answer must match")
]

NumPredict = Annotated[int, msgspec.Meta(ge=-2, le=2**31 - 1, description="-1, -2: until the end or the window")]


class Options(msgspec.Struct, kw_only=True):
    """Ollama's ``options`` (``api/types.go`` ``Options``; Modelfile parameters) that reach the sampler.

    ``num_predict`` is the most tokens to generate (-1 or -2: until an end-of-generation token or the
    window is full); ``num_keep`` the tokens a context shift keeps (llama-server's ``n_keep``, with
    ``--context-shift``); ``stop`` stop strings.  The others are llama.cpp's samplers of the same name
    (a missing one takes the server's default).  The runner's options (``num_ctx``, ``num_batch``,
    ``num_gpu``, ``main_gpu``, ``use_mmap``, ``num_thread``, ``numa``...) and ``penalize_newline`` are
    accepted and ignored: the server's flags set them.
    """

    num_keep: Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)] | None = None
    seed: Seed | None = None
    num_predict: NumPredict | None = None
    top_k: TopK | None = None
    top_p: Probability | None = None
    min_p: Probability | None = None
    typical_p: Probability | None = None
    repeat_last_n: RepeatLastN | None = None
    temperature: Float32 | None = None
    repeat_penalty: Float32 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    mirostat: Mirostat | None = None
    mirostat_tau: NonNegFloat32 | None = None
    mirostat_eta: NonNegFloat32 | None = None
    stop: list[str] | None = None


class ToolCallFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A call's function: ``name`` and ``arguments`` (a JSON object), ``index`` its place in the answer."""

    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    index: int | UnsetType = UNSET


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One tool call of an assistant message (``id``: slotserve's, for the ``tool`` message answering it)."""

    function: ToolCallFunction
    id: str | UnsetType = UNSET


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat message: ``role`` (``system``, ``user``, ``assistant`` or ``tool``), ``content``; an assistant's
    ``tool_calls`` and ``thinking``; a ``tool`` message's ``tool_name`` (the tool it answers).  ``images`` are
    refused: the model reads text only."""

    role: str
    content: str | None = None  # always written in answers ("" included), as Ollama's
    thinking: str | UnsetType = UNSET
    images: list[str] | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    tool_name: str | UnsetType = UNSET
    tool_call_id: str | UnsetType = UNSET


class ToolFunction(msgspec.Struct, kw_only=True):
    """A tool's function: ``name``, ``description`` and ``parameters`` (a JSON schema object)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


class Tool(msgspec.Struct, kw_only=True):
    """A tool the model may call (``type`` ``function``)."""

    function: ToolFunction
    type: str = "function"


class ChatRequest(msgspec.Struct, kw_only=True):
    """``POST /api/chat``: ``model``, ``messages``, ``tools``, ``format``, ``options``, ``stream`` (default
    true), ``keep_alive``, ``think``; ``truncate``, ``shift``, ``logprobs`` and ``top_logprobs`` are
    accepted and unused."""

    model: str = ""
    messages: list[Message] = msgspec.field(default_factory=list)
    tools: list[Tool] | None = None
    format: Format | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool = False
    top_logprobs: int = 0


class GenerateRequest(msgspec.Struct, kw_only=True):
    """``POST /api/generate``: ``prompt`` (with ``system``, rendered by the model's chat template unless
    ``raw``), ``context`` (the token ids a previous answer returned: this prompt continues them),
    ``format``, ``options``, ``stream`` (default true), ``keep_alive``, ``think``.  ``suffix``,
    ``images`` and ``template`` (a Go template) are refused: this server has no fill-in-the-middle,
    no vision, and renders with the model's own Jinja template."""

    model: str = ""
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    template: str = ""
    context: list[int] | None = None
    stream: bool = True
    raw: bool = False
    format: Format | None = None
    options: Options | None = None
    images: list[str] | None = None
    keep_alive: KeepAlive | None = None
    think: Think | None = None
    truncate: bool | None = None
    shift: bool | None = None
    logprobs: bool = False
    top_logprobs: int = 0


class Metrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The final chunk's figures: durations in nanoseconds (``total_duration`` the request as the server
    saw it, ``load_duration`` 0: the model is always loaded, ``prompt_eval_duration`` the prefill,
    ``eval_duration`` the generation), ``prompt_eval_count`` the prompt's tokens, ``eval_count`` the
    generated tokens."""

    total_duration: int | UnsetType = UNSET
    load_duration: int | UnsetType = UNSET
    prompt_eval_count: int | UnsetType = UNSET
    prompt_eval_duration: int | UnsetType = UNSET
    eval_count: int | UnsetType = UNSET
    eval_duration: int | UnsetType = UNSET


DoneReason = Literal["stop", "length", "load", "unload"]


class ChatResponse(Metrics, kw_only=True, omit_defaults=True):
    """One line of a ``/api/chat`` stream, or the whole answer (``done: true``, with :class:`Metrics`)."""

    model: str
    created_at: str
    message: Message
    done: bool
    done_reason: DoneReason | UnsetType = UNSET


class GenerateResponse(Metrics, kw_only=True, omit_defaults=True):
    """One line of a ``/api/generate`` stream, or the whole answer.  ``context`` (on the last): the
    conversation's token ids (the prompt's and the answer's), to send back as the next request's;
    ``thinking``: the model's thinking, split from ``response`` when the request asked ``think``."""

    model: str
    created_at: str
    response: str
    done: bool
    done_reason: DoneReason | UnsetType = UNSET
    context: list[int] | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET
    thinking: str | UnsetType = UNSET


class EmbedRequest(msgspec.Struct, kw_only=True):
    """``POST /api/embed``: ``input`` a text or texts; ``truncate`` (default true: a text longer than the
    window is cut, false: refused); ``dimensions`` keeps the first N of each vector (then normalized again);
    ``options`` and ``keep_alive`` are accepted and unused."""

    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class EmbedResponse(msgspec.Struct, kw_only=True):
    """``/api/embed``'s answer: one L2-normalized float vector per input, in order."""

    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``POST /api/embeddings`` (Ollama's older route): one ``prompt``."""

    model: str = ""
    prompt: str = ""
    options: Options | None = None
    keep_alive: KeepAlive | None = None


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    """``/api/embeddings``' answer: the prompt's pooled vector, not normalized (as Ollama's older route)."""

    embedding: list[float]


class ModelDetails(msgspec.Struct, kw_only=True):
    """A model's ``details``: ``format`` ``gguf``, ``family`` its architecture (``general.architecture``),
    ``parameter_size`` as ``135M`` / ``7.6B``, ``quantization_level`` as ``Q4_1`` (the file type)."""

    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListModel(msgspec.Struct, kw_only=True):
    """One model of ``/api/tags``: ``size`` in bytes, ``digest`` the loaded model's fingerprint."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class ListResponse(msgspec.Struct, kw_only=True):
    """``GET /api/tags``: the served model, under each of its names."""

    models: list[ListModel]


class RunningModel(msgspec.Struct, kw_only=True):
    """One model of ``/api/ps``: ``size`` and ``size_vram`` in bytes, ``context_length`` a slot's window
    (tokens), ``expires_at`` when it would be unloaded (the served model never is)."""

    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class ProcessResponse(msgspec.Struct, kw_only=True):
    """``GET /api/ps``: the loaded model."""

    models: list[RunningModel]


class ShowRequest(msgspec.Struct, kw_only=True):
    """``POST /api/show``: ``model`` (or the older ``name``); ``verbose`` adds nothing here (the
    tokenizer's arrays are not listed)."""

    model: str = ""
    name: str = ""
    verbose: bool = False
    system: str = ""
    template: str = ""
    options: dict[str, Any] | None = None


class ShowResponse(msgspec.Struct, kw_only=True):
    """``/api/show``: ``template`` is the model's Jinja chat template (GGUF ``tokenizer.chat_template``, not
    a Go template), ``parameters`` the server's sampler defaults as Modelfile lines, ``model_info`` GGUF
    metadata keys, ``capabilities`` what the model can be asked for here."""

    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(msgspec.Struct, kw_only=True):
    """``GET /api/version``: the Ollama release whose API this server follows."""

    version: str
