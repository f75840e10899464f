"""What the orchestrator needs from an engine: the :class:`EngineClient` protocol.

The orchestrator's modules hold an engine through this interface only (as vLLM's API
layer knows only its ``EngineClient``).  :class:`orchestrator.engine_client.client.WorkerClient`
implements it over a worker process (:mod:`contract.protocol`); a test can implement it
in-process.  Every method may raise :class:`EngineDeadError` (no worker, or it died
during the call) and :class:`EngineRequestError` (the engine refused the request, with an
:class:`contract.errors.ErrorCode`).

Sequences are numbered ``0..n_slots-1`` (``ModelInfo.n_slots``); token ids are
``int`` in ``[0, vocab_size)``, checked by the caller; states are llama.cpp sequence
states (``llama_state_seq_get_data``'s bytes, ``include/llama.h``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.flow import ack_due
from contract.options import CaptureOptions, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine is gone (crashed, restarting or not started); ``code`` is ``NO_MODEL``."""

    code = ErrorCode.NO_MODEL


class EngineRequestError(RuntimeError):
    """The engine refused a request: ``code`` (:class:`ErrorCode`), ``message``; ``refused``: a
    generation that changed nothing (``contract.protocol.Error.refused``)."""

    def __init__(self, code: ErrorCode, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.refused = refused


@dataclass(frozen=True)
class SequenceKV:
    """A sequence's ``tokens`` (position order) and the KV ``records`` of the position ranges asked for
    (llama.cpp's stream record of each range's cells: slotstate/kv_chunks.py), in the buffers they were
    received in; ``t_ms``: how long the engine took to read them."""

    tokens: list[int]
    records: list[proto.Buffer]
    t_ms: float


@dataclass(frozen=True)
class TokenOutput:
    """One generated token and its tensors, as raw little-endian bytes.

    ``attention`` is described by ``token.attention`` (dtype ``float32``/``float16``,
    shape ``[n_layers_sel, n_heads, n_ctx]`` or ``[n_ctx]`` when aggregated); ``hidden``
    by ``token.hidden`` (``float32[n_embd]``); ``positions`` (format ``topk``) by ``token.attention_pos``
    (``int32``, ``attention``'s shape).  Each is None when not captured.
    """

    token: proto.Token
    attention: bytes | None = None
    hidden: bytes | None = None
    positions: bytes | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors, as the worker's flow-control credit counts them (``contract.flow.Credit``)."""
        return sum(memoryview(b).nbytes for b in (self.attention, self.hidden, self.positions) if b is not None)


EngineEvent = TokenOutput | proto.Progress | proto.Done
"""What a generation stream yields: tokens (and, when asked, prefill ``Progress``), then one ``Done``."""


class GenerationStream:
    """The events of one generation (request id ``req``), in order, ending with its ``Done``.

    Iterate it once.  Leaving early (``aclose``, or the iterating task cancelled) cancels
    the generation in the engine; ``abandon`` is awaited when the stream is closed before
    its first event was asked for (the events' own clean-up has not started then).  An
    engine failure mid-way raises :class:`EngineRequestError` or :class:`EngineDeadError`
    from the iteration.

    Flow control: asking for the next event says that the consumer has taken every token
    it was given so far (it has handed the token to its client: the wire layers send a
    frame, and the server's transport applies backpressure on that send, before they ask
    again), so ``ack(n)`` is awaited first, ``n`` being the count of tokens taken
    (``Token.index + 1`` of the latest), once half of ``window`` tokens or ``window_bytes``
    bytes were taken since the last (:func:`contract.flow.ack_due`; every token when both are 0).
    The engine runs at most its flow-control window
    (``contract.protocol.Generate.window`` and ``window_bytes``; :mod:`contract.flow`)
    ahead of that count, so a slow client holds its own generation, not the server's
    memory.  Without ``ack`` (an in-process engine that decodes only as it is iterated)
    nothing is sent.
    """

    def __init__(
        self,
        req: int,
        events: AsyncGenerator[EngineEvent, None],
        abandon: Callable[[], Awaitable[None]] | None = None,
        ack: Callable[[int], Awaitable[None]] | None = None,
        window: int = 0,
        window_bytes: int = 0,
    ) -> None:
        self.req = req
        self._events = events
        self._abandon = abandon
        self._ack = ack
        self._window = (window, window_bytes)
        self._started = False
        self.taken = 0  # tokens handed to the consumer (the count the next ``ack`` reports)
        self._acked = 0
        self._taken_bytes = 0  # their tensor bytes, as the worker's credit counts them
        self._acked_bytes = 0
        self._ended = False  # ``Done`` was handed out: nothing left to acknowledge

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> EngineEvent:
        self._started = True
        if (
            self._ack is not None
            and not self._ended
            and ack_due(self.taken - self._acked, self._taken_bytes - self._acked_bytes, *self._window)
        ):
            self._acked, self._acked_bytes = self.taken, self._taken_bytes
            await self._ack(self.taken)
        event = await self._events.__anext__()
        if isinstance(event, TokenOutput):
            self.taken = event.token.index + 1
            self._taken_bytes += event.nbytes
        elif isinstance(event, proto.Done):
            self._ended = True
        return event

    async def aclose(self) -> None:
        """Stop iterating (cancels the generation unless it is done)."""
        if not self._started and self._abandon is not None:
            self._started = True
            await self._abandon()
        await self._events.aclose()


@dataclass(frozen=True)
class SequenceState:
    """A sequence's ``tokens`` (position order) and its llama.cpp sequence ``state`` bytes
    (``llama_state_seq_get_data``'s format, in the buffer it was received in: not copied);
    ``t_ms``: how long the engine took to read it."""

    tokens: list[int]
    state: proto.Buffer
    t_ms: float


@dataclass(frozen=True)
class Classification:
    """Raw logits of each input: ``logits`` is ``float32[len(inputs) * n_out]`` bytes (row-major
    ``[n_inputs, n_out]``, labels in ``ModelInfo.classifier_labels`` order); ``n_tokens[i]``: tokens
    of input ``i`` (special tokens included)."""

    n_tokens: list[int]
    n_out: int
    logits: bytes


@dataclass(frozen=True, kw_only=True)
class GenerationJob:
    """One generation as :meth:`EngineClient.generate` takes it (the fields of :class:`contract.protocol.Generate`
    the caller chooses; the client adds the request id and the flow-control window).

    ``seq``: the engine sequence; ``input_ids``: the whole context; ``params``, ``capture``: sampling and attention;
    ``progress``: ``Progress`` events while prefilling; ``cache_reuse``: llama-server's ``n_cache_reuse`` (None:
    the engine's ``--cache-reuse``); ``n_keep``, ``n_discard``: llama-server's context shift fields."""

    seq: int
    input_ids: Sequence[int]
    params: SamplingParams
    capture: CaptureOptions
    progress: bool = False
    cache_reuse: int | None = None
    n_keep: int = 0
    n_discard: int = 0


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the orchestrator uses it (see module docstring)."""

    @property
    def info(self) -> proto.ModelInfo | None:
        """The loaded model's facts (None until the engine is ready)."""
        ...

    @property
    def pieces(self) -> list[bytes]:
        """Every token's raw text bytes, indexed by token id (empty until ready)."""
        ...

    @property
    def alive(self) -> bool:
        """True while the engine is ready for requests."""
        ...

    @property
    def generation(self) -> int:
        """How many times the engine has (re)started: sequences of an older generation are gone."""
        ...

    @property
    def stage(self) -> str:
        """Start-up stage reached (``loading_model``, ``creating_context``, ``self_check``; ``ready`` once up)."""
        ...

    @property
    def load_fraction(self) -> float:
        """Model load progress, 0..1, while ``stage == "loading_model"``."""
        ...

    on_restart: Callable[[], Awaitable[None]] | None
    """Awaited after the engine restarted by itself (its sequences are then empty)."""

    async def start(self, timeout: float = 300.0) -> proto.ModelInfo:
        """Start the engine and wait until it is ready; ``timeout`` in seconds per start-up stage."""
        ...

    async def close(self) -> None:
        """Finish pending KV writes and stop the engine."""
        ...

    async def wait_ready(self, timeout: float) -> bool:
        """Wait (seconds) until the engine is ready; False on timeout."""
        ...

    async def generate(self, job: GenerationJob) -> GenerationStream:
        """Generate ``job`` (:class:`GenerationJob`): on sequence ``seq`` from the context ``input_ids``.

        The sequence's KV cache is reused for the longest common prefix with its tokens (and,
        with ``cache_reuse`` N > 0, runs of at least N tokens it holds further on, moved into
        place: llama-server's ``n_cache_reuse``; None: the engine's ``--cache-reuse``), the rest
        is prefilled; afterwards the sequence holds ``input_ids`` + the generated
        tokens (less what a context shift drops: with the engine's ``--context-shift``, a generation that
        fills the window drops ``n_discard`` tokens after the first ``n_keep``, llama-server's fields;
        ``proto.Generate``).  With ``progress``, ``Progress`` events come while prefilling.  The request
        is with the engine when this returns (later requests are applied after it).
        Errors (``SLOT_BUSY``, ``CONTEXT_OVERFLOW``, ``INVALID_REQUEST``, ``OOM``) are
        raised by the stream's iteration.  The engine may run only a few tokens ahead of
        the stream's consumer (:class:`GenerationStream`, "Flow control").
        """
        ...

    async def preview(
        self,
        seq: int | None,
        input_ids: Sequence[int],
        append: Sequence[int],
        params: SamplingParams,
        capture: CaptureOptions,
    ) -> GenerationStream:
        """Generate on a copy-on-write fork of sequence ``seq`` after prefilling ``append``
        on the fork; the fork is discarded at the end and ``seq`` is untouched.

        With ``seq`` None the preview starts from ``input_ids`` (no cached context).  The
        fork is taken before any later request is applied.  ``NO_CACHED_CONTEXT`` when
        there is nothing to continue, ``RATE_LIMITED`` when every spare sequence is in use.
        """
        ...

    async def cancel(self, req: int) -> None:
        """Stop generation ``req`` within one decode step (its stream ends with ``Done``, ``cancelled``)."""
        ...

    async def tokens(self, seq: int) -> list[int]:
        """The tokens whose KV is in sequence ``seq``, in position order."""
        ...

    async def erase(self, seq: int) -> None:
        """Drop every KV cell of ``seq`` (``SLOT_BUSY`` while it generates)."""
        ...

    async def truncate(self, seq: int, n_keep: int) -> list[int]:
        """Keep the first ``n_keep`` tokens of ``seq``; returns its tokens."""
        ...

    async def fork(self, seq: int, target: int) -> list[int]:
        """Make ``target`` a copy-on-write copy of ``seq`` (cells shared); returns ``target``'s tokens."""
        ...

    async def context_shift(self, seq: int, n_keep: int, n_discard: int) -> list[int]:
        """Drop ``n_discard`` tokens after the first ``n_keep`` and move the rest down
        (llama-server's context shift); returns the tokens.  ``INVALID_REQUEST`` unless
        ``n_keep >= 0``, ``n_discard > 0`` and ``n_keep + n_discard <= len(tokens)``."""
        ...

    async def save_state(self, seq: int) -> SequenceState:
        """The tokens and llama.cpp sequence state of ``seq`` (``SLOT_BUSY`` while it generates)."""
        ...

    async def read_kv(self, seq: int, ranges: Sequence[proto.KVRange]) -> SequenceKV:
        """The tokens whose KV is in ``seq`` and the KV record of each of ``ranges``
        (``llama_attn_seq_range_get``: only those cells are read), ``SLOT_BUSY`` while it generates.
        Unlike :meth:`tokens` it leaves the last generated token's pending write alone (a decode step):
        the tokens are one fewer then, as llama-server's slot save stores them; no ranges: only them."""
        ...

    def release_state(self, state: proto.Buffer) -> None:
        """Hand back the buffer a :meth:`save_state` reply's ``state`` (or one of a :meth:`read_kv` reply's
        ``records``) arrived in, once nothing reads it any more: the client may receive the next state
        into it.  Anything else is left alone, and a state never handed back is simply freed."""
        ...

    async def restore_state(self, seq: int, tokens: Sequence[int], state: proto.Buffer) -> float:
        """Replace ``seq`` with ``tokens`` and their llama.cpp sequence ``state``; returns ms taken.

        The state is checked first: ``BAD_STATE`` (another model or build, damaged,
        positions not ``0..len(tokens)-1``) or ``CONTEXT_OVERFLOW`` leave ``seq`` as it was.
        """
        ...

    async def save_file(self, seq: int, path: str) -> proto.FileSaved:
        """Write ``seq`` to ``path`` (absolute, on the worker's file system) as llama-server's slot
        file (``proto.SaveFile``); ``INVALID_REQUEST`` when ``path`` names a directory, ``INTERNAL``
        when the write fails (the file is then as it was)."""
        ...

    async def load_file(self, seq: int, path: str) -> proto.StateRestored:
        """Replace ``seq`` with the slot file at ``path`` (``proto.LoadFile``): refused as
        :meth:`restore_state` refuses a state (``seq`` as it was), ``INVALID_REQUEST`` for a
        missing file."""
        ...

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> proto.TokenizeResult:
        """Token ids of UTF-8 ``text`` and each token's raw bytes (llama.cpp's ``llama_tokenize``)."""
        ...

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The text of token ids (special tokens rendered)."""
        ...

    async def classify(self, texts: Sequence[str]) -> Classification:
        """Raw logits of each text (a classifier engine only; others answer ``INVALID_REQUEST``)."""
        ...

    async def engine_state(self) -> proto.EngineState:
        """Which sequences generate."""
        ...

    async def check_sampling(self, params: SamplingParams) -> None:
        """Build ``params``' sampler chain in the worker and free it; raises ``EngineRequestError``
        (``INVALID_GRAMMAR``) when its grammar or JSON schema cannot be used."""
        ...
