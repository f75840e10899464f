"""What a generation yields to the API surfaces: the one place the worker's messages become domain events.

:class:`TokenStream` turns the engine's token events into :class:`TokenOut` (with incremental UTF-8 text) and
its ``Progress`` into :class:`ProgressOut`; :meth:`DoneOut.of` turns its ``Done`` into the end a client sees.
The surfaces (``orchestrator/api/*/``) turn these into their own stream events; none of them reads the worker
protocol (``contract/protocol.py``).
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from contract import protocol as proto
from orchestrator.engine_client.interface import EngineEvent, TokenOutput


@dataclass
class TokenOut:
    """One generated token as the wire encoders need it.

    ``text`` is the token's text from an incremental UTF-8 decoder over the stream
    (a piece that ends mid-character yields ``""`` and the character comes with the
    next token, so concatenating ``text`` is always the exact output); ``piece`` are
    the raw bytes.  ``attention`` is raw little-endian ``dtype`` bytes of ``shape``.  ``shift``:
    ``(n_keep, n_discard)`` on the first token after a context shift (``--context-shift``): the slot's
    tokens ``n_keep .. n_keep+n_discard-1`` were dropped, so attention positions from ``n_keep`` on are
    ``n_discard`` lower than before.  ``prob`` and ``top_probs`` (``(token_id, p)``, best first): with
    llama-server's ``post_sampling_probs`` the probabilities after the sampler chain, in place of ``logprob``'s
    companion ``top`` (the model's own distribution, ``(token_id, logprob)``).  Reduced attention (docs/api.md,
    "Attention formats"): ``positions`` the ``int32`` input positions of ``topk`` weights (``attention_shape``),
    ``sink`` the mass on the first ``attention_sink`` positions, ``context_length`` the row's length in tokens.
    """

    index: int
    token_id: int
    piece: bytes
    text: str
    logprob: float | None
    top: list[tuple[int, float]]
    attention: bytes | None
    attention_shape: list[int]
    hidden: bytes | None
    is_stop: bool
    shift: tuple[int, int] | None = None
    prob: float | None = None
    top_probs: list[tuple[int, float]] = field(default_factory=list)
    positions: bytes | None = None
    sink: float | None = None
    context_length: int = 0


@dataclass
class Started:
    """First item of every run: the request is valid, the slot is held, the worker has it."""

    slot_id: str


@dataclass
class PreviewStarted:
    """First item of a preview: ``cache_hit`` says it runs on a fork of ``slot_id``'s cached
    context (else on a scratch sequence from the request's ``input_ids``)."""

    cache_hit: bool
    slot_id: str


@dataclass
class ProgressOut:
    """Prefill progress: ``processed`` of ``total`` prompt tokens are in the KV cache, ``cache`` of them
    were reused, after ``time_ms`` milliseconds (llama-server's ``prompt_progress``, ``return_progress``)."""

    total: int
    cache: int
    processed: int
    time_ms: float


class DoneOut(proto.Done, kw_only=True):
    """End of a generation as the surfaces see it: the worker's :class:`contract.protocol.Done` (``finish_reason``:
    length, stop_token, stop_string or cancelled; token counts ``n_prompt``, ``n_cached`` of it reused from the KV
    cache, ``n_prefilled`` decoded, ``n_generated`` new tokens, ``seq_tokens`` the slot's tokens now, 0 for a
    preview; the worker's ``t_prefill_ms``, ``t_generate_ms``; ``n_discarded``, ``truncated``: context shifts) and
    what the orchestrator adds: ``text``, the whole output; ``generation_time_ms``, the whole request as the
    orchestrator saw it; ``slot_id``, the slot it ran on."""

    text: str = ""
    generation_time_ms: float = 0.0
    slot_id: str = "0"

    @classmethod
    def of(cls, done: proto.Done, text: str, generation_time_ms: float, slot_id: str) -> DoneOut:
        """The end a client sees, from the worker's ``Done``."""
        return cls(**msgspec.structs.asdict(done), text=text, generation_time_ms=generation_time_ms, slot_id=slot_id)


class TokenStream:
    """Turns engine ``Token`` events into :class:`TokenOut` (incremental UTF-8 text)."""

    def __init__(self, stop_ids: set[int]) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.stop_ids = stop_ids

    async def events(self, stream: AsyncIterator[EngineEvent]) -> AsyncIterator[TokenOut | ProgressOut | proto.Done]:
        """The engine's events of one request (a :class:`orchestrator.engine_client.interface.GenerationStream`):
        each token as a :class:`TokenOut` (:meth:`convert`), ``Progress`` as a :class:`ProgressOut`, the
        final ``Done`` as it comes."""
        async for event in stream:
            if isinstance(event, TokenOutput):
                yield self.convert(event)
            elif isinstance(event, proto.Progress):
                yield ProgressOut(event.n_total, event.n_cached, event.n_done, event.t_ms)
            else:
                yield event

    def convert(self, out: TokenOutput) -> TokenOut:
        """Attach the token's text."""
        msg = out.token
        return TokenOut(
            index=msg.index,
            token_id=msg.token_id,
            piece=msg.piece,
            text=self.decoder.decode(msg.piece),
            logprob=msg.logprob,
            top=list(msg.top),
            attention=out.attention,
            attention_shape=list(msg.attention.shape) if msg.attention is not None else [],
            hidden=out.hidden,
            is_stop=msg.token_id in self.stop_ids,
            shift=msg.shift,
            prob=msg.prob,
            top_probs=list(msg.top_probs),
            positions=out.positions,
            sink=msg.sink,
            context_length=msg.n_ctx,
        )


class TokenWatcher(Protocol):
    """Something that watches every generated token besides its client (the admin page's live feed,
    :class:`orchestrator.generation.feed.AttentionFeed`); the generation service is handed one and does not
    know what it is."""

    def publish(self, slot_id: str, t: TokenOut, fmt: str, dtype: str, layers: list[int] | None) -> None:
        """See ``t``, a token of ``slot_id`` whose attention is ``dtype`` bytes in ``fmt`` over ``layers``."""
