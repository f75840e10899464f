"""``n`` > 1 completions: forks of one prefilled prompt.

The prompt is prefilled into the request's slot once (a generation of 0 tokens, which leaves
the prompt's KV cells in the slot), and while the slot is still held, ``n`` copy-on-write forks
of it (``llama_memory_seq_cp``: the previews' mechanism,
:meth:`orchestrator.engine_client.interface.EngineClient.preview` with nothing appended) generate
the ``n`` choices concurrently on spare engine sequences, each re-decoding the prompt's last token
for its own logits.  The slot keeps the prompt; the forks are
discarded.  llama-server does the same with ``n_cmpl`` child tasks that copy the parent slot's
prompt (``tools/server/server-context.cpp``, ``copy_state_to``), and limits ``n`` to its slots;
here ``n`` is limited to the spare sequences (``--spare``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import msgspec

from contract import protocol as proto
from contract.errors import ErrorCode
from orchestrator.engine_client.interface import GenerationStream
from orchestrator.generation.capture import capture_options
from orchestrator.generation.events import DoneOut, TokenOut, TokenStream
from orchestrator.generation.interleave import interleaved
from orchestrator.generation.request import CanonicalRequest
from orchestrator.generation.service import GenerationService, RunControl
from orchestrator.service_error import ServiceError
from orchestrator.slots.model import Slot


@dataclass
class ChoiceEvent:
    """One event of choice ``index`` (0..n-1): a generated token or its end."""

    index: int
    event: TokenOut | DoneOut


async def forked_choices(
    generation: GenerationService, req: CanonicalRequest, n: int, n_spare: int, control: RunControl | None = None
) -> AsyncGenerator[ChoiceEvent | DoneOut, None]:
    """Prefill ``req``'s prompt into its slot, then generate ``n`` choices on forks of it.

    Yields the prefill's :class:`DoneOut` first (``n_prompt``, ``n_cached``: the usage's prompt
    figures), then every choice's events as they come, each choice ending with its own
    :class:`DoneOut`.  Raises :class:`ServiceError` before the first yield for a bad request, and
    ``INVALID_REQUEST`` when ``n`` exceeds ``n_spare`` (the spare sequences the forks run on).
    Closing the iterator cancels every choice still generating.
    """
    if not 1 <= n <= max(1, n_spare):
        most = max(1, n_spare)
        raise ServiceError(ErrorCode.INVALID_REQUEST, f"n must be in 1..{most} (the server's --spare sequences)")
    info = generation.info
    ids = await generation.input_ids(req)  # its checks with the request's own max_new_tokens
    params = await generation.checked_params(req)
    if info.runtime.context_shift:  # a fork cannot shift its window (its prompt is shared): it ends at it
        params = msgspec.structs.replace(params, max_new_tokens=min(params.max_new_tokens, info.n_ctx - len(ids)))
    capture = capture_options(req, info, ids)
    streams: list[GenerationStream] = []

    async def fork(slot: Slot) -> None:
        assert slot.seq is not None
        for _ in range(n):  # submitted while the slot is held: every fork copies the prefilled prompt
            streams.append(await generation.engine.preview(slot.seq, [], [], params, capture))

    prefill = msgspec.structs.replace(req, max_new_tokens=0)
    prefilled: DoneOut | None = None
    try:
        async for ev in generation.run(prefill, control, then=fork):
            if isinstance(ev, DoneOut):
                prefilled = ev
        assert prefilled is not None
        yield prefilled
        async for out in _merged(streams, set(params.stop_tokens) | set(info.eog_token_ids), prefilled.slot_id):
            yield out
    finally:
        for stream in streams:
            await stream.aclose()


async def _merged(streams: list[GenerationStream], stop_ids: set[int], slot_id: str) -> AsyncIterator[ChoiceEvent]:
    """The events of every fork, interleaved as they arrive, each tagged with its choice index."""

    async def events(index: int, stream: GenerationStream) -> AsyncIterator[ChoiceEvent]:
        converter = TokenStream(stop_ids)
        texts: list[str] = []
        t0 = time.perf_counter()
        async for event in converter.events(stream):
            if isinstance(event, TokenOut):
                if not event.is_stop:
                    texts.append(event.text)
                yield ChoiceEvent(index, event)
            elif isinstance(event, proto.Done):
                text = "".join(texts) + converter.decoder.decode(b"", final=True)
                yield ChoiceEvent(index, DoneOut.of(event, text, (time.perf_counter() - t0) * 1000, slot_id))

    async with contextlib.aclosing(interleaved([events(i, s) for i, s in enumerate(streams)])) as merged:
        async for _, item in merged:
            yield item
