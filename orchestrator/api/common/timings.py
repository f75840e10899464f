"""llama-server's ``timings`` object: of a finished generation, and while a stream runs.

The shape is llama-server's ``result_timings::to_json`` (``tools/server/server-task.cpp``): prompt tokens
decoded (``prompt_n``, besides ``cache_n`` reused from the KV cache) and generated (``predicted_n``), their
milliseconds, milliseconds per token and tokens per second (0 where a count or a time is 0).
"""

from __future__ import annotations

import time

import msgspec
from msgspec import UNSET, UnsetType

from orchestrator.generation.events import DoneOut, ProgressOut


def _timings(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> Timings:
    """Generation rates are over the decode steps, one fewer than the tokens: the first token comes from the
    prompt's logits (llama-server's ``result_timings``, ``server-common.h``)."""

    def rate(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1000.0 * n / ms if ms > 0 else 0.0)

    p_tok, p_s = rate(prompt_n, prompt_ms)
    g_tok, g_s = rate(max(predicted_n - 1, 0), predicted_ms)
    return Timings(
        cache_n=cache_n,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=p_tok,
        prompt_per_second=p_s,
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=g_tok,
        predicted_per_second=g_s,
    )


def timings_of(d: DoneOut) -> Timings:
    """The ``timings`` of a finished generation (the worker's counts and milliseconds)."""
    return _timings(d.n_cached, d.n_prefilled, d.t_prefill_ms, d.n_generated, d.t_generate_ms)


class TimingsClock:
    """``timings`` so far of a running generation, as llama-server adds them to every streamed chunk
    with ``timings_per_token`` (its ``slot.stats`` at each token).

    Fed the run's :class:`ProgressOut` events (the request must ask for them: ``req.progress``) and its
    tokens: the prompt figures are the last progress report's (the worker's clock); generation time is
    measured here, from the end of the prefill (the last report, else the first token) to now.
    Off (``on`` false: the request did not ask for ``timings_per_token``), every
    reading is unset, so a stream feeds it unconditionally.
    """

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.cache_n = 0
        self.prompt_n = 0
        self.prompt_ms = 0.0
        self.predicted_n = 0
        self.t_generate: float | None = None  # time.perf_counter() when generation began

    def progress(self, p: ProgressOut) -> None:
        """A prefill step: ``p.processed`` of the prompt's tokens are in the cache, ``p.cache`` reused."""
        decoded = p.processed - p.cache  # before the first batch: none, and no time spent on it (llama-server)
        self.cache_n, self.prompt_n, self.prompt_ms = p.cache, decoded, p.time_ms if decoded > 0 else 0.0
        self.t_generate = time.perf_counter()

    def token(self) -> None:
        """One more generated token."""
        self.predicted_n += 1
        if self.t_generate is None:
            self.t_generate = time.perf_counter()

    def now(self) -> Timings | UnsetType:
        """The ``timings`` as of now (unset when off)."""
        if not self.on:
            return UNSET
        t0 = self.t_generate if self.t_generate is not None else time.perf_counter()
        ms = (time.perf_counter() - t0) * 1000.0 if self.predicted_n else 0.0  # nothing generated: no time
        return _timings(self.cache_n, self.prompt_n, self.prompt_ms, self.predicted_n, ms)

    def final(self, done: DoneOut) -> Timings | UnsetType:
        """The ``timings`` of the finished generation (the worker's figures; unset when off)."""
        return timings_of(done) if self.on else UNSET


class Timings(msgspec.Struct, kw_only=True):
    """llama-server's ``timings``: prompt and generation counts (tokens), times (ms) and rates."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
