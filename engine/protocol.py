"""The worker protocol: every message between the orchestrator and an engine worker.

This module is the table of contents of the IPC.  Messages are ``msgspec`` Structs
encoded as msgpack (tagged unions, ``array_like``); tensors (attention rows, hidden
states, KV state blobs) travel beside the message as raw byte buffers, never
base64 and never pickle.

Frame layout on the stream (little-endian)::

    u32 meta_len | u16 n_bufs | u16 flags(0) | u64 buf_len[n_bufs] | meta (msgpack) | buf_0 ... buf_{n-1}

Requests carry a ``req`` id chosen by the orchestrator; every reply and event carries
the id of the request it belongs to.  Buffers are attached to the message that
documents them (``Token``: attention then hidden state; ``StateBlob`` /
``RestoreState``: the llama.cpp sequence state).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Literal

import msgspec

_HEAD = struct.Struct("<IHH")
_LEN = struct.Struct("<Q")
MAX_META_BYTES = 64 << 20
MAX_BUF_BYTES = 8 << 30


class ProtocolError(RuntimeError):
    """The peer sent a malformed frame or closed the stream mid-frame."""


# ----------------------------------------------------------------------------- shared structs


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampler chain settings (llama.cpp samplers, llama-server names).

    ``temperature <= 0`` means greedy; ``seed == -1`` means random.  Token ids are
    already validated against the vocabulary by the orchestrator.
    """

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1
    banned_tokens: list[int] = []
    stop_tokens: list[int] = []
    stop_strings: list[str] = []
    ignore_eos: bool = False
    n_probs: int = 0  # how many top_logprobs per token (0: none)
    logprobs: bool = False  # compute the sampled token's logprob


class CaptureOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What to capture per generated token.

    ``attention``: rows of ``kq_soft_max-{il}`` gathered into input-position order,
    ``float32[n_layers_sel, n_heads, n_ctx]`` (``per_layer``) or the mean over layers
    and heads ``float[n_ctx]`` (``aggregated``); ``dtype`` ``float32`` or ``float16``.
    ``layers``: subset of layer indices (default all).  ``hidden_state``: the final
    hidden state ``float32[n_embd]``.
    """

    attention: bool = False
    format: str = "per_layer"
    dtype: str = "float32"
    layers: list[int] | None = None
    hidden_state: bool = False


# ----------------------------------------------------------------------------- orchestrator -> worker


class Generate(msgspec.Struct, tag="generate", array_like=True, omit_defaults=True):
    """Generate on sequence ``seq``.

    ``mode="generate"``: the sequence's KV is reused for the longest common prefix of
    ``input_ids`` and its tokens, the rest is prefilled, and the sequence keeps the
    result (``input_ids`` + generated).  ``mode="preview"``: the sequence is forked
    copy-on-write into a spare sequence, ``append`` is prefilled on the fork, and the
    fork is discarded at the end; the sequence is untouched.  With ``seq == -1`` a
    preview runs from ``input_ids`` on a scratch sequence.
    """

    req: int
    seq: int
    mode: str
    input_ids: list[int]
    params: SamplingParams
    capture: CaptureOptions
    append: list[int] = []
    progress: bool = False  # send ``Progress`` while prefilling (llama-server's ``return_progress``)


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """Stop request ``target`` within one decode step (its events end with ``Done``)."""

    req: int
    target: int


class Tokenize(msgspec.Struct, tag="tokenize", array_like=True):
    """Tokenize UTF-8 text. ``add_special`` adds BOS/EOS as the model wants; ``parse_special``
    turns ``<|im_start|>``-like text into control tokens."""

    req: int
    text: str
    add_special: bool
    parse_special: bool


class Detokenize(msgspec.Struct, tag="detokenize", array_like=True):
    """Token ids to text (special tokens rendered)."""

    req: int
    ids: list[int]


class SeqOp(msgspec.Struct, tag="seq_op", array_like=True, omit_defaults=True):
    """A KV sequence operation.

    ``op``: ``tokens`` (reply ``SeqInfo``), ``erase`` (drop all cells), ``fork``
    (copy-on-write copy of ``seq`` into ``arg0`` = target sequence),
    ``context_shift`` (``arg0`` = n_keep, ``arg1`` = n_discard), ``save_state``
    (reply ``StateBlob``).
    """

    req: int
    op: str
    seq: int
    arg0: int = 0
    arg1: int = 0


class RestoreState(msgspec.Struct, tag="restore", array_like=True):
    """Restore sequence ``seq`` from ``tokens`` + a llama.cpp sequence state (buffer 0).

    The state is parsed and checked against this model first (layout, and K/V values
    all finite), then restored into a scratch sequence; only when that succeeds does it
    replace ``seq``.  A refused
    state leaves ``seq`` exactly as it was (reply ``Error`` with ``BAD_STATE``).
    """

    req: int
    seq: int
    tokens: list[int]


class Classify(msgspec.Struct, tag="classify", array_like=True):
    """Classify each text with the worker's classifier model (reply ``Classified``)."""

    req: int
    texts: list[str]


class Status(msgspec.Struct, tag="status", array_like=True):
    """Where the sequences' KV cells are (reply ``EngineState``)."""

    req: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish and exit."""

    req: int


# ----------------------------------------------------------------------------- worker -> orchestrator


class EngineRuntime(msgspec.Struct, kw_only=True):
    """The engine configuration in force (``/health``, ``GET /api/v1/model``'s ``engine``).

    ``devices``: ggml backend devices as ``NAME (description)``; ``backend``: the device
    type layers run on (``CPU``, ``GPU``); ``extra_bufts``: the CPU backend's extra buffer
    types on this host and ``use_extra_bufts`` whether the model uses them (llama-server's
    ``--no-repack`` is False), with ``repack_reason``; ``eval_filter``: how attention rows
    are read (``c``, ``python``, or ``off`` without capture); ``system_info``: llama.cpp's
    ``llama_print_system_info`` line.
    """

    backend: str
    devices: list[str]
    n_gpu_layers: int
    n_layers_offloaded: int
    extra_bufts: list[str]
    use_extra_bufts: bool
    repack_reason: str
    flash_attn: bool
    type_k: str
    type_v: str
    kv_unified: bool
    n_threads: int
    n_seq_max: int
    eval_filter: str
    self_check_ms: float
    system_info: str


class ModelInfo(msgspec.Struct, kw_only=True):
    """Model and engine facts; fields as docs/api.md lists them for ``GET /api/v1/model``, llama.cpp's names."""

    model_name: str
    model_path: str
    architecture: str
    description: str
    fingerprint: str
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    n_ctx: int
    n_ctx_train: int
    n_kv_cells: int
    n_slots: int
    rope_freq_base: float
    rope_freq_scale: float
    bos_token_id: int
    eos_token_id: int
    eot_token_id: int
    eog_token_ids: list[int]
    special_tokens: dict[str, str | int]
    chat_template: str
    n_params: int
    size_bytes: int
    llama_cpp_version: str
    runtime: EngineRuntime
    classifier_labels: list[str] = []  # a classifier's output labels, in logit order


StartStage = Literal["loading_model", "creating_context", "self_check"]


class Starting(msgspec.Struct, tag="starting", array_like=True):
    """Start-up progress, sent before ``Ready``: the stage the worker entered and, while
    loading the model, the fraction loaded (llama.cpp's progress callback, 0..1)."""

    req: int
    stage: StartStage
    fraction: float = 0.0


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """Sent once when the model is loaded; ``pieces[t]`` is token ``t``'s raw text bytes."""

    req: int
    info: ModelInfo
    pieces: list[bytes]


class Token(msgspec.Struct, tag="token", array_like=True, omit_defaults=True):
    """One generated token.

    Buffers: ``[attention]`` or ``[attention, hidden]`` or ``[hidden]`` as flagged.
    ``n_ctx`` is the attention length (``len(input_ids) + index``).  ``top`` is
    ``[(token_id, logprob), ...]`` best first.
    """

    req: int
    index: int
    token_id: int
    piece: bytes
    logprob: float | None = None
    top: list[tuple[int, float]] = []
    n_ctx: int = 0
    attention_shape: list[int] = []
    has_attention: bool = False
    has_hidden: bool = False


class Progress(msgspec.Struct, tag="progress", array_like=True):
    """Prefill progress of a generation: ``n_done`` of ``n_total`` prompt tokens processed.

    ``n_cached`` of them came from the KV cache (llama-server's ``prompt_progress``:
    ``total``, ``cache``, ``processed``, ``time_ms``).
    """

    req: int
    n_total: int
    n_cached: int
    n_done: int
    t_ms: float


class Done(msgspec.Struct, tag="done", array_like=True, omit_defaults=True):
    """End of a generation. ``finish_reason``: length, stop_token, stop_string, cancelled."""

    req: int
    finish_reason: str
    n_prompt: int
    n_cached: int
    n_prefilled: int
    n_generated: int
    t_prefill_ms: float
    t_generate_ms: float
    stop_string: str = ""
    seq_tokens: int = 0


class Error(msgspec.Struct, tag="error", array_like=True):
    """A request failed; ``code`` is one of the API error codes (docs/api.md, "Errors")."""

    req: int
    code: str
    message: str


class TokenizeResult(msgspec.Struct, tag="tokenized", array_like=True):
    """``ids`` and each token's raw piece bytes."""

    req: int
    ids: list[int]
    pieces: list[bytes]


class DetokenizeResult(msgspec.Struct, tag="detokenized", array_like=True):
    """Detokenized text."""

    req: int
    text: str


class SeqInfo(msgspec.Struct, tag="seq_info", array_like=True):
    """A sequence's tokens (the tokens whose KV is in the cache, in position order)."""

    req: int
    seq: int
    tokens: list[int]


class Classified(msgspec.Struct, tag="classified", array_like=True):
    """Raw logits of each text (buffer 0: ``float32[len(n_tokens), n_out]``) and its token count."""

    req: int
    n_tokens: list[int]
    n_out: int


class EngineState(msgspec.Struct, tag="engine_state", array_like=True):
    """``offloaded``: sequences whose cells were moved to host memory (``--cache-idle-slots``);
    ``generating``: sequences with an active generation."""

    req: int
    offloaded: list[int]
    generating: list[int]


class StateBlob(msgspec.Struct, tag="state", array_like=True):
    """A sequence's tokens and its llama.cpp sequence state (buffer 0)."""

    req: int
    seq: int
    tokens: list[int]
    t_ms: float


Request = Generate | Cancel | Tokenize | Detokenize | SeqOp | RestoreState | Classify | Status | Shutdown
Reply = (
    Starting
    | Ready
    | Token
    | Progress
    | Done
    | Error
    | TokenizeResult
    | DetokenizeResult
    | SeqInfo
    | StateBlob
    | Classified
    | EngineState
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)

Buffer = bytes | bytearray | memoryview


def parse_address(addr: str) -> tuple[int, object]:
    """``unix:/path`` or ``tcp:host:port`` (a worker's address) to ``(family, sockaddr)``; ValueError otherwise."""
    kind, _, rest = addr.partition(":")
    if kind == "unix":
        return socket.AF_UNIX, rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return socket.AF_INET, (host or "127.0.0.1", int(port))
    raise ValueError(f"bad address {addr!r}: use unix:/path or tcp:host:port")


def encode_frame(msg: msgspec.Struct, buffers: Sequence[Buffer] = ()) -> list[Buffer]:
    """The frame for ``msg`` and its raw ``buffers`` as a list of byte chunks (for ``sendmsg``)."""
    meta = _encoder.encode(msg)
    views = [memoryview(b).cast("B") for b in buffers]
    head = _HEAD.pack(len(meta), len(views), 0) + b"".join(_LEN.pack(v.nbytes) for v in views)
    return [head, meta, *views]


def send_frame(sock: socket.socket, msg: msgspec.Struct, buffers: Sequence[Buffer] = ()) -> None:
    """Write one frame to a blocking socket (gathered write, no copy of the buffers)."""
    views = [memoryview(c).cast("B") for c in encode_frame(msg, buffers)]
    while views:
        sent = sock.sendmsg(views)
        # a partial write: go on from where it stopped, still without copying
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views:
            views[0] = views[0][sent:]


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("peer closed the stream")
        got += k
    return buf


def _check_sizes(meta_len: int, lens: Sequence[int]) -> None:
    if meta_len > MAX_META_BYTES or any(n > MAX_BUF_BYTES for n in lens):
        raise ProtocolError(f"frame too large: meta={meta_len} bufs={list(lens)}")


def recv_request(sock: socket.socket) -> tuple[Request, list[bytearray]]:
    """Read one request frame from a blocking socket (worker side)."""
    meta_len, n_bufs, _ = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    lens = [_LEN.unpack(_recv_exact(sock, 8))[0] for _ in range(n_bufs)]
    _check_sizes(meta_len, lens)
    meta = _recv_exact(sock, meta_len)
    bufs = [_recv_exact(sock, n) for n in lens]
    try:
        return _request_decoder.decode(meta), bufs
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad request frame: {exc}") from exc


async def read_reply(reader: object) -> tuple[Reply, list[bytes]]:
    """Read one reply frame from an ``asyncio.StreamReader`` (orchestrator side)."""
    head = await reader.readexactly(_HEAD.size)  # type: ignore[attr-defined]
    meta_len, n_bufs, _ = _HEAD.unpack(head)
    lens = [_LEN.unpack(await reader.readexactly(8))[0] for _ in range(n_bufs)]  # type: ignore[attr-defined]
    _check_sizes(meta_len, lens)
    meta = await reader.readexactly(meta_len)  # type: ignore[attr-defined]
    bufs = [await reader.readexactly(n) for n in lens]  # type: ignore[attr-defined]
    try:
        return _reply_decoder.decode(meta), bufs
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad reply frame: {exc}") from exc
