"""The credit scheme of flow control with fakes, no model: :class:`contract.flow.Credit` (the worker's
side) and :class:`orchestrator.engine_client.interface.GenerationStream`'s acknowledgements (the orchestrator's),
then both together: a fake worker that decodes only while its credit lasts, read by a slow
consumer, never has more than the window queued."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from contract import protocol as proto
from contract.flow import Credit
from orchestrator.engine_client.interface import EngineEvent, GenerationStream, TokenOutput

MB = 1 << 20


def test_a_token_window_is_spent_by_tokens_not_taken() -> None:
    c = Credit(window=3)
    for _ in range(3):
        assert not c.spent()
        c.emit(MB)
    assert c.spent() and c.outstanding == 3 and c.outstanding_bytes == 3 * MB
    c.ack(1)
    assert not c.spent() and c.outstanding == 2 and c.outstanding_bytes == 2 * MB
    c.ack(1)  # the same count again, or an older one, moves nothing
    c.ack(0)
    assert c.acked == 1
    c.ack(99)  # past what was emitted: everything emitted is taken, no credit in advance
    assert c.acked == 3 and c.outstanding == 0 and c.outstanding_bytes == 0
    for _ in range(3):
        c.emit(0)
    assert c.spent()


def test_a_byte_window_is_spent_by_the_bytes_not_taken() -> None:
    c = Credit(window_bytes=5 * MB)
    c.emit(2 * MB)
    c.emit(2 * MB)
    assert not c.spent()  # 4 MB outstanding: one more may go
    c.emit(3 * MB)
    assert c.spent() and c.outstanding_bytes == 7 * MB  # at most the window plus one token
    c.ack(1)
    assert c.outstanding_bytes == 5 * MB and c.spent()
    c.ack(2)
    assert c.outstanding_bytes == 3 * MB and not c.spent()


def test_one_token_always_goes_however_large() -> None:
    c = Credit(window=4, window_bytes=MB)
    assert not c.spent()
    c.emit(100 * MB)
    assert c.spent()
    c.ack(1)
    assert not c.spent()


def test_no_window_is_never_spent() -> None:
    c = Credit()
    for _ in range(1000):
        c.emit(MB)
    assert not c.spent() and c.outstanding == 1000


def _token(i: int, size: int = 0) -> TokenOutput:
    """Token ``i`` with ``size`` bytes of attention (the credit's count)."""
    return TokenOutput(proto.Token(1, i, 42, b"x"), bytes(size) if size else None, None)


def _done(n: int) -> proto.Done:
    return proto.Done(1, "length", 3, 0, 3, n, 1.0, 1.0)


def test_the_stream_acknowledges_what_its_consumer_took_when_it_asks_again() -> None:
    acks: list[int] = []

    async def events() -> AsyncGenerator[EngineEvent, None]:
        yield proto.Progress(1, 3, 0, 3, 1.0)  # not a token: nothing to acknowledge after it
        for i in range(3):
            yield _token(i)
        yield _done(3)

    async def ack(n: int) -> None:
        acks.append(n)

    async def main() -> None:
        stream = GenerationStream(1, events(), ack=ack)
        got = [await anext(stream)]  # the Progress
        got.append(await anext(stream))  # token 0: taken, not yet acknowledged
        assert acks == []
        got.append(await anext(stream))  # asking for token 1 acknowledges token 0
        assert acks == [1]
        got += [ev async for ev in stream]  # token 2, then Done: one Ack per ask, none after Done
        assert acks == [1, 2, 3] and isinstance(got[-1], proto.Done) and len(got) == 5

    asyncio.run(main())


class FakeWorker:
    """Emits ``n`` tokens of ``size`` bytes into a reply queue, one per ``step_s``, while its
    :class:`Credit` lasts; ``Ack`` restores it (as ``Batcher.held`` and ``Batcher.ack`` do)."""

    def __init__(self, n: int, size: int, credit: Credit, step_s: float) -> None:
        self.n, self.size, self.credit, self.step_s = n, size, credit, step_s
        self.queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.wake = asyncio.Event()
        self.most_queued = 0  # tokens in the queue at its fullest
        self.most_bytes = 0

    async def run(self) -> None:
        for i in range(self.n):
            while self.credit.spent():  # held: the worker decodes the other jobs, not this one
                self.wake.clear()
                await self.wake.wait()
            await asyncio.sleep(self.step_s)
            self.queue.put_nowait(_token(i, self.size))
            self.credit.emit(self.size)
            self.most_queued = max(self.most_queued, self.queue.qsize())
            self.most_bytes = max(self.most_bytes, self.queue.qsize() * self.size)
        self.queue.put_nowait(_done(self.n))

    async def ack(self, n: int) -> None:
        self.credit.ack(n)
        self.wake.set()

    async def events(self) -> AsyncGenerator[EngineEvent, None]:
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, proto.Done):
                return


def test_a_slow_consumer_holds_the_fake_worker_to_its_window() -> None:
    """The engine 10x faster than its reader: at most the window is ever queued, and every token arrives."""

    async def main(credit: Credit, size: int) -> FakeWorker:
        worker = FakeWorker(30, size, credit, step_s=0.001)
        producer = asyncio.create_task(worker.run())
        stream = GenerationStream(
            1, worker.events(), ack=worker.ack, window=credit.window, window_bytes=credit.window_bytes
        )
        indexes = []
        async for ev in stream:
            if isinstance(ev, TokenOutput):
                indexes.append(ev.token.index)
            await asyncio.sleep(0.01)  # the client reads ten times slower than the worker makes tokens
        await producer
        assert indexes == list(range(30))
        return worker

    by_tokens = asyncio.run(main(Credit(window=4), MB))
    assert by_tokens.most_queued <= 4
    by_bytes = asyncio.run(main(Credit(window=100, window_bytes=5 * MB), 2 * MB))
    assert by_bytes.most_bytes <= 6 * MB  # under the 5 MB window plus one 2 MB token
    unbounded = asyncio.run(main(Credit(), MB))
    assert unbounded.most_queued > 10  # without a window the queue grows with the reader's lag
    print(
        f"\nqueued at most: window 4 -> {by_tokens.most_queued}, 5 MB -> {by_bytes.most_bytes / MB:.0f} MB, "
        f"no window -> {unbounded.most_queued} tokens"
    )


def _acks_of(n: int, size: int, window: int, window_bytes: int) -> list[int]:
    """The ``Ack`` counts a consumer taking ``n`` tokens of ``size`` bytes as fast as they come sends."""
    acks: list[int] = []

    async def events() -> AsyncGenerator[EngineEvent, None]:
        for i in range(n):
            yield _token(i, size)
        yield _done(n)

    async def ack(k: int) -> None:
        acks.append(k)

    async def main() -> None:
        stream = GenerationStream(1, events(), ack=ack, window=window, window_bytes=window_bytes)
        got = [ev async for ev in stream]
        assert len(got) == n + 1

    asyncio.run(main())
    return acks


def test_acknowledgements_are_batched_within_the_window() -> None:
    assert _acks_of(8, 0, window=4, window_bytes=0) == [2, 4, 6, 8]  # half the token window
    assert _acks_of(6, 2 * MB, window=100, window_bytes=5 * MB) == [2, 4, 6]  # 4 MB >= half of 5 MB
    assert _acks_of(3, 100 * MB, window=4, window_bytes=MB) == [1, 2, 3]  # a token past the byte window: each
    assert _acks_of(3, 0, window=1, window_bytes=0) == [1, 2, 3]
    assert _acks_of(3, 0, window=0, window_bytes=0) == [1, 2, 3]  # no window known: every token


def test_batched_acknowledgements_never_hold_a_fast_consumer() -> None:
    """A consumer faster than the worker gets every token with one Ack per two (window 4), or per token
    when one token's tensors exceed half the byte window, the fake worker holding to its credit."""

    async def main(credit: Credit, size: int) -> tuple[list[int], int]:
        worker = FakeWorker(20, size, credit, step_s=0.001)
        producer = asyncio.create_task(worker.run())
        acks: list[int] = []

        async def ack(n: int) -> None:
            acks.append(n)
            await worker.ack(n)

        stream = GenerationStream(1, worker.events(), ack=ack, window=credit.window, window_bytes=credit.window_bytes)
        n = sum([isinstance(ev, TokenOutput) async for ev in stream])
        await asyncio.wait_for(producer, 10)
        return acks, n

    acks, n = asyncio.run(main(Credit(window=4, window_bytes=16 * MB), 1000))
    assert n == 20 and acks == list(range(2, 21, 2))
    acks, n = asyncio.run(main(Credit(window=4, window_bytes=3 * MB), 2 * MB))
    assert n == 20 and acks == list(range(1, 21))
