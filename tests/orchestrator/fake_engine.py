"""An in-memory engine for in-process tests of the orchestrator (no llama.cpp, no worker process).

:class:`FakeEngine` answers what the orchestrator asks of
:class:`orchestrator.engine_client.interface.EngineClient` with a list of tokens per sequence:

* ``generate`` reuses the longest common prefix of a sequence's tokens with the request's
  ``input_ids`` (``n_cached``), then yields ``max_new_tokens`` deterministic tokens
  (:func:`next_token`), one per ``step_s`` seconds; a ``Cancel`` (or leaving the stream)
  ends it with ``finish_reason="cancelled"`` and the tokens generated so far stay in the sequence,
  as in the worker.  It decodes a token only when the stream is asked for one, so it never runs
  ahead of its consumer (the worker's flow control, ``Generate.window`` and ``Ack``, with nothing
  to acknowledge: its streams take no ``ack``);
* ``fork`` copies a sequence's tokens; ``erase``, ``context_shift`` and ``tokens`` act on them;
* ``save_state`` returns a blob that encodes the tokens (``b"FAKE"`` + u32 count + i32 ids,
  little-endian) and ``restore_state`` refuses one whose tokens differ (``BAD_STATE``);
* ``read_kv`` returns llama.cpp stream records (slotstate/kv_chunks.py) of one layer whose K and V rows
  are the cells' token ids (int32), so a state assembled from them restores with ``restore_state``
  (which reads the tokens back out of such a state);
* as the worker, it writes a generation's last token to the KV cache only when the next operation on
  the sequence comes (:attr:`FakeEngine.pending`); ``read_kv`` leaves it pending and answers the
  tokens without it;
* a KV operation on a sequence that is generating answers ``SLOT_BUSY``, as the worker does;
* :meth:`FakeEngine.restart` empties every sequence and bumps ``generation`` (a worker restart).

It implements the ``EngineClient`` protocol of ``orchestrator/engine_client/interface.py`` (its names,
parameters and result types: ``tokens``, ``erase``, ``truncate``, ``fork``, ``context_shift``,
``save_state``, ``restore_state``, ``generate``, ...).
:attr:`FakeEngine.calls` records every KV operation as ``(name, seq)``.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.model_facts import EngineRuntime, ModelInfo
from contract.options import CaptureOptions, SamplingParams
from orchestrator.engine_client.interface import (
    EngineRequestError,
    GenerationJob,
    SequenceKV,
    SequenceState,
    TokenOutput,
)
from slotstate import seq_state

VOCAB = 512
EOG = VOCAB - 1


class GenerationStream:
    """The events of generation ``req`` (the shape of ``engine_api.GenerationStream``).

    ``wrap`` turns each engine event into what the caller iterates; :meth:`aclose` (or the end
    of the events) frees the sequence, whether or not the iteration started.
    """

    def __init__(
        self,
        req: int,
        events: AsyncGenerator[proto.Token | proto.Done, None],
        wrap: Callable[[proto.Token | proto.Done], object],
        end: Callable[[], None],
    ) -> None:
        self.req = req
        self._events = events
        self._wrap = wrap
        self._end = end

    def __aiter__(self) -> AsyncIterator[object]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[object]:
        try:
            async for event in self._events:
                yield self._wrap(event)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop (the generation ends; tokens generated so far stay in the sequence)."""
        await self._events.aclose()
        self._end()


def next_token(context: Sequence[int]) -> int:
    """The fake model's greedy choice after ``context``: a function of the last two tokens (never EOG)."""
    a = context[-1] if context else 1
    b = context[-2] if len(context) > 1 else 0
    return (a * 31 + b * 7 + 3) % (VOCAB - 1)


def state_blob(tokens: Sequence[int]) -> bytes:
    """The fake "llama.cpp sequence state" of ``tokens``."""
    return b"FAKE" + struct.pack(f"<I{len(tokens)}i", len(tokens), *tokens)


def kv_record(tokens: Sequence[int], p0: int, p1: int, seq: int) -> bytes:
    """The fake KV record of positions ``[p0, p1)``: one layer, K and V rows one int32 token id each."""
    cells = range(p0, min(p1, len(tokens)))
    if not cells:
        return struct.pack("<I", 0)
    ids = struct.pack(f"<{len(cells)}i", *tokens[cells.start : cells.stop])
    meta = b"".join(struct.pack("<iIi", p, 1, seq) for p in cells)
    return struct.pack("<I", len(cells)) + meta + struct.pack("<II", 0, 1) + (struct.pack("<iQ", 0, 4) + ids) * 2


def state_tokens(blob: bytes | memoryview) -> list[int] | None:
    """The tokens a fake state encodes (``FAKE``, or a llama.cpp state of :func:`kv_record`'s records), or
    None for anything else."""
    data = bytes(blob)
    if data[:4] == struct.pack("<I", seq_state.IO_MAGIC):
        try:
            parsed = seq_state.parse(data)
        except seq_state.BadStateError:
            return None
        if not parsed.data:
            return []
        _, off, size = parsed.data[0]
        return list(struct.unpack_from(f"<{size // 4}i", data, off))
    if len(data) < 8 or data[:4] != b"FAKE":
        return None
    (n,) = struct.unpack_from("<I", data, 4)
    if len(data) != 8 + 4 * n:
        return None
    return list(struct.unpack_from(f"<{n}i", data, 8))


def model_info(n_slots: int, n_ctx: int = 4096) -> ModelInfo:
    """A :class:`contract.protocol.ModelInfo` for the fake model."""
    runtime = EngineRuntime(
        backend="fake",
        devices=[],
        n_gpu_layers=0,
        n_layers_offloaded=0,
        extra_bufts=[],
        use_extra_bufts=False,
        repack_reason="",
        flash_attn=False,
        type_k="f16",
        type_v="f16",
        kv_unified=False,
        n_threads=1,
        n_seq_max=n_slots + 2,
        capture="graph",
        self_check_ms=0.0,
        system_info="",
    )
    return ModelInfo(
        model_name="fake",
        model_path="",
        architecture="fake",
        description="in-memory test engine",
        fingerprint="fake-model-1",
        vocab_size=VOCAB,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_size=8,
        n_ctx=n_ctx,
        n_ctx_train=n_ctx,
        n_kv_cells=n_ctx,
        n_slots=n_slots,
        attention_layers=[0, 1],
        rope_freq_base=10000.0,
        rope_freq_scale=1.0,
        bos_token_id=0,
        eos_token_id=EOG,
        eot_token_id=EOG,
        eog_token_ids=[EOG],
        special_tokens={},
        chat_template="",
        n_params=0,
        size_bytes=0,
        llama_cpp_version="fake",
        runtime=runtime,
    )


class FakeEngine:
    """In-memory engine with ``n_slots`` sequences (see module docstring)."""

    def __init__(self, n_slots: int, step_s: float = 0.002) -> None:
        self.info: ModelInfo | None = model_info(n_slots)
        self.pieces = [f" t{i}".encode() for i in range(VOCAB)]
        self.generation = 1
        self.alive = True
        self.stage = "ready"
        self.load_fraction = 1.0
        self.step_s = step_s
        self.seqs: dict[int, list[int]] = {}
        self.generating: dict[int, int] = {}  # seq -> request id
        self.pending: set[int] = set()  # sequences whose last token is not written to the KV cache yet
        self.cancelled: set[int] = set()
        self.calls: list[tuple[str, int]] = []
        self.lent: list[object] = []  # every record read_kv returned (release_state must take each back)
        self.released: list[object] = []  # what release_state was handed
        self.on_restart: Callable[[], Awaitable[None]] | None = None
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        """A fresh request id."""
        return next(self._ids)

    def count(self, name: str) -> int:
        """How many ``name`` operations were made."""
        return sum(1 for op, _ in self.calls if op == name)

    def _idle(self, seq: int, name: str, flush: bool = True) -> list[int]:
        self.calls.append((name, seq))
        if seq in self.generating:
            raise EngineRequestError(ErrorCode.SLOT_BUSY, f"sequence {seq} is generating")
        if flush:
            self.pending.discard(seq)
        return self.seqs.setdefault(seq, [])

    async def start(self, timeout: float = 300.0) -> ModelInfo:
        """Already started: the model info."""
        assert self.info is not None
        return self.info

    async def close(self) -> None:
        """Stop answering."""
        self.alive = False

    async def wait_ready(self, timeout: float) -> bool:
        """True while alive."""
        return self.alive

    async def restart(self) -> None:
        """The worker died and came back: every sequence is empty, ``generation`` moves on."""
        self.seqs.clear()
        self.pending.clear()
        self.generation += 1
        if self.on_restart is not None:
            await self.on_restart()

    # ------------------------------------------------------------------ typed operations

    async def tokens(self, seq: int) -> list[int]:
        """The sequence's tokens."""
        return list(self._idle(seq, "tokens"))

    async def erase(self, seq: int) -> None:
        """Empty the sequence."""
        self._idle(seq, "erase").clear()

    async def truncate(self, seq: int, n_keep: int) -> list[int]:
        """Keep the first ``n_keep`` tokens."""
        toks = self._idle(seq, "truncate")
        del toks[n_keep:]
        return list(toks)

    async def fork(self, seq: int, target: int) -> list[int]:
        """``target`` becomes a copy of ``seq``; returns its tokens."""
        src = self._idle(seq, "fork")
        self.seqs[target] = list(src)
        return list(src)

    async def context_shift(self, seq: int, n_keep: int, n_discard: int) -> list[int]:
        """Drop ``n_discard`` tokens after the first ``n_keep``."""
        toks = self._idle(seq, "context_shift")
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > len(toks):
            raise EngineRequestError(ErrorCode.INVALID_REQUEST, "bad context shift")
        del toks[n_keep : n_keep + n_discard]
        return list(toks)

    async def save_state(self, seq: int) -> SequenceState:
        """The tokens and the fake state of ``seq``."""
        toks = list(self._idle(seq, "save_state"))
        return SequenceState(toks, state_blob(toks), 0.0)

    async def read_kv(self, seq: int, ranges: Sequence[proto.KVRange]) -> SequenceKV:
        """The fake KV records (:func:`kv_record`) of ``ranges`` of the first KV cache (the fake has one)."""
        toks = list(self._idle(seq, "read_kv", flush=False))
        if seq in self.pending:
            toks.pop()
        if any(r.cache != 0 for r in ranges):
            raise EngineRequestError(ErrorCode.INVALID_REQUEST, "the fake model has one KV cache")
        records = [kv_record(toks, r.p0, r.p1, seq) for r in ranges]
        self.lent += records
        return SequenceKV(toks, records, 0.0)

    def release_state(self, state: proto.Buffer) -> None:
        """Record what is handed back (:attr:`released`; the fake's states are plain bytes)."""
        self.released.append(state)

    async def restore_state(self, seq: int, tokens: Sequence[int], state: proto.Buffer) -> float:
        """Replace ``seq``; ``BAD_STATE`` (sequence unchanged) unless ``state`` encodes ``tokens``."""
        self._idle(seq, "restore")
        if state_tokens(memoryview(state).cast("B")) != list(tokens):
            raise EngineRequestError(ErrorCode.BAD_STATE, "the state does not match its tokens")
        self.seqs[seq] = list(tokens)
        return 0.0

    async def save_file(self, seq: int, path: str) -> proto.FileSaved:
        """Write the fake state of ``seq`` to ``path`` (as the fake state, not a ggsq file)."""
        blob = state_blob(self._idle(seq, "save_file"))
        Path(path).write_bytes(blob)
        return proto.FileSaved(0, seq, len(state_tokens(blob) or []), len(blob), 0.0)

    async def load_file(self, seq: int, path: str) -> proto.StateRestored:
        """Replace ``seq`` from a file :meth:`save_file` wrote (``INVALID_REQUEST`` when missing)."""
        try:
            blob = Path(path).read_bytes()
        except OSError as exc:
            raise EngineRequestError(ErrorCode.INVALID_REQUEST, f"no saved slot file {path!r}") from exc
        tokens = state_tokens(blob)
        if tokens is None:
            raise EngineRequestError(ErrorCode.BAD_STATE, "not a fake state file")
        await self.restore_state(seq, tokens, blob)
        return proto.StateRestored(0, seq, len(tokens), 0.0, len(blob))

    async def generate(self, job: GenerationJob) -> GenerationStream:
        """Prefill (prefix reuse) and ``max_new_tokens`` deterministic tokens, then ``Done``
        (:class:`TokenOutput` per token); ``cache_reuse`` and the context shift are not modelled."""
        msg = proto.Generate(
            self.new_id(), job.seq, "generate", list(job.input_ids), job.params, job.capture, progress=job.progress
        )
        return self._start(msg, lambda ev: TokenOutput(ev) if isinstance(ev, proto.Token) else ev)

    async def preview(
        self,
        seq: int | None,
        input_ids: Sequence[int],
        append: Sequence[int],
        params: SamplingParams,
        capture: CaptureOptions,
    ) -> GenerationStream:
        """Not modelled: ``NOT_SUPPORTED``."""
        raise EngineRequestError(ErrorCode.NOT_SUPPORTED, "the fake engine has no preview")

    def _start(self, msg: proto.Generate, wrap: Callable[[proto.Token | proto.Done], object]) -> GenerationStream:
        """Take the sequence and prefill now (``SLOT_BUSY`` if it generates); the decode runs as it is iterated."""
        seq, req = msg.seq, msg.req
        toks = self._idle(seq, "generate")
        self.generating[seq] = req
        n_cached = 0
        for a, b in zip(toks, msg.input_ids, strict=False):
            if a != b:
                break
            n_cached += 1
        n_cached = min(n_cached, len(msg.input_ids) - 1)  # the last input token is always decoded
        del toks[n_cached:]
        toks.extend(msg.input_ids[n_cached:])

        def end() -> None:
            if self.generating.get(seq) == req:
                del self.generating[seq]
            self.cancelled.discard(req)

        return GenerationStream(req, self._decode(msg, toks, n_cached), wrap, end)

    async def _decode(
        self, msg: proto.Generate, toks: list[int], n_cached: int
    ) -> AsyncGenerator[proto.Token | proto.Done, None]:
        req, reason, n = msg.req, "length", 0
        while n < msg.params.max_new_tokens:
            await asyncio.sleep(self.step_s)
            if msg.req in self.cancelled:
                reason = "cancelled"
                break
            tok = next_token(toks)
            toks.append(tok)
            n += 1
            yield proto.Token(req, n - 1, tok, self.pieces[tok])
            if tok in msg.params.stop_tokens:
                reason = "stop_token"
                break
        n_prompt = len(msg.input_ids)
        if n:
            self.pending.add(msg.seq)
        yield proto.Done(req, reason, n_prompt, n_cached, n_prompt - n_cached, n, 0.0, 0.0, "", len(toks))

    async def cancel(self, req: int) -> None:
        """Stop generation ``req``: its sequence is free at once (the worker ends a cancelled
        generation at its next step, whether or not its events are read); its stream ends with
        ``Done`` (``cancelled``) when read."""
        self.cancelled.add(req)
        for seq, r in list(self.generating.items()):
            if r == req:
                del self.generating[seq]

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> proto.TokenizeResult:
        """One token per character (code point modulo the vocabulary)."""
        ids = [ord(c) % (VOCAB - 1) for c in text]
        return proto.TokenizeResult(self.new_id(), ids, [self.pieces[i] for i in ids])

    async def detokenize(self, ids: Sequence[int]) -> str:
        """The pieces joined."""
        return b"".join(self.pieces[i] for i in ids).decode()

    async def classify(self, texts: Sequence[str]) -> object:
        """Not a classifier: ``INVALID_REQUEST``, as a generating worker answers."""
        raise EngineRequestError(ErrorCode.INVALID_REQUEST, "not a classifier")

    async def check_sampling(self, params: SamplingParams) -> None:
        """A grammar without a ``root`` rule is refused (the fake parses nothing else)."""
        if params.grammar and "root" not in params.grammar:
            raise EngineRequestError(ErrorCode.INVALID_GRAMMAR, "no root rule")

    async def engine_state(self) -> proto.EngineState:
        """The generating sequences."""
        return proto.EngineState(self.new_id(), sorted(self.generating))
