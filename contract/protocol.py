"""The worker protocol: every message between the orchestrator and an engine worker.

This module is the table of contents of the IPC.  It stays one module by design (SGLang's ``io_struct.py``
is the same): adding a message is one Struct and one row of a union, and a reader finds every message here.
Each message is one ``msgspec``
Struct derived from :class:`Message` (which carries ``req``), encoded as msgpack in a
tagged array (the tag is the class name).  :data:`Request` lists what the orchestrator
sends, :data:`Reply` what the worker answers; a frame whose tag is in neither is
refused (:class:`ProtocolError`).  Frames and addresses: :mod:`contract.framing`; the options a
generation carries (``Generate.params``, ``Generate.capture``): :mod:`contract.options`.

Tensors (attention rows, hidden states, KV state blobs, logits) travel beside the
message as raw little-endian buffers, never base64 and never pickle.  The message
describes each one with a :class:`Tensor`: which buffer of the frame, its dtype and its
shape, so a receiver needs nothing else to read it.

``req``: chosen by the orchestrator per request; every reply carries its request's.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import ClassVar, Literal

import msgspec

from contract.buffers import BufferPool
from contract.errors import ErrorCode
from contract.framing import (
    Buffer,
    FrameStream,
    NonNegInt,
    ProtocolError,
    RecvBuffer,
    Tensor,
    frame_chunks,
    recv_frame,
    send_chunks,
)
from contract.model_facts import ModelInfo
from contract.options import CaptureOptions, SamplingParams

# ----------------------------------------------------------------------------- shared structs


class Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Every message: ``req`` is the id of the request (a reply carries its request's)."""

    req: int


# ----------------------------------------------------------------------------- orchestrator -> worker

GenerateMode = Literal["generate", "preview"]


class Generate(Message):
    """Generate on sequence ``seq``.

    ``mode="generate"``: the sequence's KV is reused for the longest common prefix of
    ``input_ids`` and its tokens, the rest is prefilled, and the sequence keeps the
    result (``input_ids`` + generated).  ``mode="preview"``: the sequence is forked
    copy-on-write into a spare sequence, ``append`` is prefilled on the fork, and the
    fork is discarded at the end; the sequence is untouched.  With ``seq == -1`` a
    preview runs from ``input_ids`` on a spare sequence.  Replies: ``Progress`` (with
    ``progress``), ``Token`` per generated token, then ``Done``; or ``Error``.
    """

    seq: int
    mode: GenerateMode
    input_ids: list[int]
    params: SamplingParams
    capture: CaptureOptions
    append: list[int] = []
    progress: bool = False  # send ``Progress`` while prefilling (llama-server's ``return_progress``)
    # llama-server's ``n_cache_reuse``: runs of at least this many tokens after the common prefix that the
    # sequence's cache holds further on are moved into place instead of prefilled (Engine.reuse_chunks);
    # 0: off; None: the engine's ``--cache-reuse``
    cache_reuse: NonNegInt | None = None
    # Flow control (contract/flow.py): at most ``window`` tokens, and while less than ``window_bytes``
    # bytes of their tensors are outstanding, emitted ahead of what the orchestrator acknowledged
    # (``Ack``); past that the worker holds this sequence (other jobs go on).  0: that bound off.
    window: NonNegInt = 0
    window_bytes: NonNegInt = 0
    # llama-server's context shift (``--context-shift``, EngineSettings.context_shift; tools/server/README.md,
    # ``n_keep``/``n_discard``): when the sequence fills its window during generation, ``n_discard`` tokens
    # (0: half of those after the kept ones) after the first ``n_keep`` (-1: the whole prompt; a BOS the
    # model adds is kept beside them) are dropped and the rest moved down
    n_keep: int = 0
    n_discard: NonNegInt = 0


class Cancel(Message):
    """Stop request ``target`` within one decode step (its events end with ``Done``); no reply."""

    target: int


class Ack(Message):
    """The client of request ``target`` has taken its first ``n`` tokens (flow control of
    ``Generate.window`` and ``window_bytes``); no reply.  An ``Ack`` for a finished request is ignored."""

    target: int
    n: int


class Tokenize(Message):
    """Tokenize UTF-8 text (reply ``TokenizeResult``). ``add_special`` adds BOS/EOS as the model
    wants; ``parse_special`` turns ``<|im_start|>``-like text into control tokens."""

    text: str
    add_special: bool
    parse_special: bool


class Detokenize(Message):
    """Token ids to text, special tokens rendered (reply ``DetokenizeResult``)."""

    ids: list[int]


class SeqRequest(Message):
    """An operation on the KV cells of sequence ``seq`` (``0..n_slots-1``).

    ``writes``: the operation changes the sequence, so it is refused (``SLOT_BUSY``) while
    a generation owns it.  The worker first writes the sequence's pending last token.
    """

    seq: int
    writes: ClassVar[bool] = True


class Tokens(SeqRequest):
    """The sequence's tokens (reply ``SeqTokens``)."""

    writes: ClassVar[bool] = False


class Erase(SeqRequest):
    """Drop every cell of the sequence (reply ``SeqTokens``, empty)."""


class Truncate(SeqRequest):
    """Keep the first ``n_keep`` tokens (``llama_memory_seq_rm(seq, n_keep, -1)``; reply ``SeqTokens``)."""

    n_keep: NonNegInt


class Fork(SeqRequest):
    """Make ``target`` a copy-on-write copy of ``seq`` (``llama_memory_seq_cp``: cells shared;
    reply ``SeqTokens`` of ``target``).  ``seq`` itself is only read."""

    target: int
    writes: ClassVar[bool] = False


class ContextShift(SeqRequest):
    """Drop ``n_discard`` tokens after the first ``n_keep`` and move the rest down
    (``seq_rm`` + ``seq_add``, llama-server's context shift; reply ``SeqTokens``)."""

    n_keep: int
    n_discard: int


class SaveState(SeqRequest):
    """Read the sequence's llama.cpp state (``llama_state_seq_get_data``; reply ``StateBlob``)."""


class KVRange(msgspec.Struct, array_like=True, frozen=True):
    """Positions ``[p0, p1)`` of KV cache ``cache`` (0: the global or only one, 1: a sliding-window
    model's sliding layers)."""

    cache: int
    p0: int
    p1: int


class ReadKV(SeqRequest):
    """Read the KV of position ranges of the sequence (``llama_attn_seq_range_get``, libllama/llama-attn.h;
    reply ``KVRecords``): per range llama.cpp's stream record of its cells (slotstate/kv_chunks.py).

    Unlike the other operations it leaves the pending last token unwritten (writing it is a decode step):
    the reply's tokens are those whose KV is in the cache, as llama-server's slot save stores them.  No
    ranges: only those tokens."""

    ranges: list[KVRange]


class RestoreState(SeqRequest):
    """Replace the sequence with ``tokens`` and the llama.cpp sequence state ``state`` (``uint8[n]``).

    The state is parsed and checked against this model first (layout, and K/V values all
    finite), then restored into a scratch sequence; only when that succeeds does it
    replace ``seq``.  A refused state leaves ``seq`` exactly as it was (reply ``Error``
    with ``BAD_STATE``); else reply ``StateRestored``.
    """

    tokens: list[int]
    state: Tensor


class SaveFile(SeqRequest):
    """Write the sequence to ``path`` as llama-server's slot file (llama.cpp's ``ggsq`` sequence
    state file: :mod:`slotstate.ggsq`), beside it first and renamed over it (reply ``FileSaved``).

    ``path`` is absolute, on a file system the worker shares with the orchestrator (which
    confined it to ``--slot-save-path``).  The sequence is only read.
    """

    path: str
    writes: ClassVar[bool] = False


class LoadFile(SeqRequest):
    """Replace the sequence with the slot file at ``path`` (llama-server's or ours; reply
    ``StateRestored``).  Checked as ``RestoreState`` checks a state (layout, K/V values all
    finite, positions, vocabulary); a refused file leaves the sequence exactly as it was
    (reply ``Error``: ``BAD_STATE``, or ``INVALID_REQUEST`` for a missing file)."""

    path: str


class Classify(Message):
    """Classify each text with the worker's classifier model, or embed it with an embedder
    worker (``EngineSettings.embedder``: the rows are pooled embeddings; reply ``Classified``)."""

    texts: list[str]


class CheckSampling(Message):
    """Build the sampler chain of ``params`` and free it (reply ``SamplingChecked``, or ``Error`` with
    ``INVALID_GRAMMAR``): lets the orchestrator refuse a grammar llama.cpp cannot parse before a slot changes."""

    params: SamplingParams


class Status(Message):
    """Where the sequences' KV cells are (reply ``EngineState``)."""


class Shutdown(Message):
    """Write pending tokens, answer ``Stopped`` and exit."""


class Release(Message):
    """The orchestrator holds no view of the shared region's ranges at ``offsets`` any more (each the first
    offset of a ``FLAG_SHARED`` frame's buffers, :mod:`contract.shm`): the worker may reuse them.  No reply;
    an offset not in use is ignored."""

    offsets: list[NonNegInt]


# ----------------------------------------------------------------------------- worker -> orchestrator

StartStage = Literal["loading_model", "creating_context", "self_check"]


class Starting(Message):
    """Start-up progress, sent before ``Ready``: the stage the worker entered and, while
    loading the model, the fraction loaded (llama.cpp's progress callback, 0..1)."""

    stage: StartStage
    fraction: float = 0.0


class Ready(Message):
    """Sent once when the model is loaded; ``pieces[t]`` is token ``t``'s raw text bytes."""

    info: ModelInfo
    pieces: list[bytes]


class Token(Message):
    """One generated token.

    ``top`` is ``[(token_id, logprob), ...]`` best first (the model's own distribution).  With
    ``SamplingParams.post_sampling_probs`` (and ``n_probs`` > 0) ``top`` stays empty and ``prob`` is the
    sampled token's probability after the sampler chain, ``top_probs`` ``[(token_id, prob), ...]`` the
    ``n_probs`` most likely after it, best first, none at 0 (llama-server's ``post_sampling_probs``).
    ``n_ctx`` is the attention
    length (``len(input_ids) + index``, less what context shifts dropped).  ``attention``: the token's
    attention rows (``CaptureOptions``: ``[n_layers_sel, n_heads, n_ctx]`` or ``[n_ctx]``, float32 or
    float16); ``hidden``: its final hidden state (``float32[n_embd]``).  ``shift``: set on the first token
    after a context shift (``Generate.n_keep``): ``(n_keep, n_discard)``, the sequence's tokens
    ``n_keep .. n_keep+n_discard-1`` were dropped and the later ones moved down by ``n_discard``
    positions, so this row's position ``p >= n_keep`` is the earlier row's ``p + n_discard``.
    ``attention_pos`` (format ``topk``): ``int32`` input positions of ``attention``'s weights, its shape;
    ``sink`` (``CaptureOptions.sink``): the mean weight mass on the first ``sink`` positions.
    """

    index: int
    token_id: int
    piece: bytes
    logprob: float | None = None
    top: list[tuple[int, float]] = []
    n_ctx: int = 0
    attention: Tensor | None = None
    hidden: Tensor | None = None
    shift: tuple[int, int] | None = None
    prob: float | None = None
    top_probs: list[tuple[int, float]] = []
    attention_pos: Tensor | None = None
    sink: float | None = None


class Progress(Message):
    """Prefill progress of a generation: ``n_done`` of ``n_total`` prompt tokens processed.

    ``n_cached`` of them came from the KV cache (llama-server's ``prompt_progress``:
    ``total``, ``cache``, ``processed``, ``time_ms``).
    """

    n_total: int
    n_cached: int
    n_done: int
    t_ms: float


FinishReason = Literal["length", "stop_token", "stop_string", "cancelled"]
"""Why a generation ended (docs/api.md): ``max_new_tokens`` reached, an end-of-generation or stop
token, a stop string, or cancelled.  The APIs map it to their own (OpenAI's and llama-server's
``finish_reason``: ``length`` / ``stop``; llama-server's ``stop_type``: ``limit``, ``eos``, ``word``)."""


class Done(Message):
    """End of a generation; ``seq_tokens``: the sequence's tokens now (0 for a preview);
    ``n_discarded``: tokens context shifts dropped (``Generate.n_keep``); ``truncated``: the generation
    shifted its window or ended at it (llama-server's ``truncated``)."""

    finish_reason: FinishReason
    n_prompt: int
    n_cached: int
    n_prefilled: int
    n_generated: int
    t_prefill_ms: float
    t_generate_ms: float
    stop_string: str = ""
    seq_tokens: int = 0
    n_discarded: int = 0
    truncated: bool = False


class Error(Message):
    """A request failed (docs/api.md, "Errors").  ``refused``: a generation was refused before
    it changed anything (its sequence's tokens and KV cells are as they were)."""

    code: ErrorCode
    message: str
    refused: bool = False


class TokenizeResult(Message):
    """``ids`` and each token's raw piece bytes."""

    ids: list[int]
    pieces: list[bytes]


class DetokenizeResult(Message):
    """Detokenized text."""

    text: str


class SeqTokens(Message):
    """A sequence's tokens (whose KV is in the cache, in position order) after an operation on it."""

    seq: int
    tokens: list[int]


class StateBlob(Message):
    """A sequence's tokens and its llama.cpp sequence ``state`` (``uint8[n]``); ``t_ms``: time to read it."""

    seq: int
    tokens: list[int]
    t_ms: float
    state: Tensor


class KVRecords(Message):
    """The sequence's tokens and one record (``uint8[n]``) per range of ``ReadKV``, in its order;
    ``t_ms``: time to read them."""

    seq: int
    tokens: list[int]
    t_ms: float
    records: list[Tensor]


class StateRestored(Message):
    """``seq`` now holds ``n_tokens`` tokens from a restored state; ``t_ms``: time the restore took;
    ``n_bytes``: bytes of the file read (``LoadFile``; 0 otherwise)."""

    seq: int
    n_tokens: int
    t_ms: float
    n_bytes: int = 0


class FileSaved(Message):
    """``seq``'s ``n_tokens`` tokens were written as a slot file of ``n_bytes`` bytes in ``t_ms`` ms."""

    seq: int
    n_tokens: int
    n_bytes: int
    t_ms: float


class Classified(Message):
    """``logits``: raw logits of each text (``float32[n_texts, n_out]``); ``n_tokens``: each text's tokens."""

    n_tokens: list[int]
    logits: Tensor


class SamplingChecked(Message):
    """The answer to ``CheckSampling``: the chain can be built."""


class EngineState(Message):
    """``generating``: sequences with an active generation.  The shared region (:mod:`contract.shm`;
    all 0 without one): ``shm_bytes`` its size, ``shm_free`` its bytes not in use, ``shm_frames`` the token
    frames whose tensors went through it and ``inline_frames`` those that found no room there."""

    generating: list[int]
    shm_bytes: int = 0
    shm_free: int = 0
    shm_frames: int = 0
    inline_frames: int = 0


class Stopped(Message):
    """The answer to ``Shutdown``: pending tokens are written, the worker exits."""


Request = (
    Generate
    | Cancel
    | Ack
    | Release
    | Tokenize
    | Detokenize
    | Tokens
    | Erase
    | Truncate
    | Fork
    | ContextShift
    | SaveState
    | ReadKV
    | RestoreState
    | SaveFile
    | LoadFile
    | Classify
    | CheckSampling
    | Status
    | Shutdown
)
Reply = (
    Starting
    | Ready
    | Token
    | Progress
    | Done
    | Error
    | TokenizeResult
    | DetokenizeResult
    | SeqTokens
    | StateBlob
    | KVRecords
    | StateRestored
    | FileSaved
    | Classified
    | SamplingChecked
    | EngineState
    | Stopped
)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_frame(msg: Message, buffers: Sequence[Buffer] = ()) -> list[Buffer]:
    """The frame of ``msg`` and its raw ``buffers`` as byte chunks (for ``writelines``)."""
    return frame_chunks(_encoder.encode(msg), buffers)


def encode_meta(msg: Message) -> bytes:
    """``msg`` as a frame's msgpack header (:func:`contract.framing.frame_chunks` adds its buffers)."""
    return _encoder.encode(msg)


def send_frame(sock: socket.socket, msg: Message, buffers: Sequence[Buffer] = ()) -> None:
    """Write one frame to a blocking socket (gathered write, no copy of the buffers)."""
    send_chunks(sock, encode_frame(msg, buffers))


def recv_request(sock: socket.socket, pool: BufferPool | None = None) -> tuple[Request, list[RecvBuffer]]:
    """Read one request frame from a blocking socket (worker side); ProtocolError when malformed.
    Large buffers are lent by ``pool`` when one is given (see :func:`contract.framing.recv_frame`)."""
    meta, bufs = recv_frame(sock, pool)
    try:
        return _request_decoder.decode(meta), bufs
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad request frame: {exc}") from exc


async def read_reply(stream: FrameStream) -> tuple[Reply, list[RecvBuffer]]:
    """Read one reply frame from the worker's stream (orchestrator side); ProtocolError when
    malformed or once the stream is closed."""
    meta, bufs = await stream.read_frame()
    try:
        return _reply_decoder.decode(meta), bufs
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad reply frame: {exc}") from exc
