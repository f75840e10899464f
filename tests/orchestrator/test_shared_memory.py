"""Tokens' tensors through the shared region (contract/shm.py) against a real worker: the rows equal the
socket path's bit for bit, several streams at once hold their views safely, a stream that is not read
holds at most its window of the region and gives it all back when abandoned, a full region falls back to
the socket, a restarted worker never writes into the mapping an older one lent, a TCP worker stays inline."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable

from contract import protocol as proto
from contract.options import CaptureOptions, SamplingParams
from contract.settings import EngineSettings
from contract.shm import ALIGN
from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import GenerationJob, GenerationStream, TokenOutput
from orchestrator.engine_client.launch import WorkerOptions
from tests.conftest import ROOT
from tests.redis_server import free_port

FULL = CaptureOptions(attention=True, format="per_layer", dtype="float32", hidden_state=True)
HALF = CaptureOptions(attention=True, format="per_layer", dtype="float16")
TOPK = CaptureOptions(attention=True, format="topk", top_k=5)
PROMPTS = [
    "The river valley and its towns, told year by year, from the first farms on. " * 3,
    "A short note.",
    "Write a poem about the sea, the wind and a lighthouse keeper who counts the ships. " * 2,
]
Rows = list[tuple[int, bytes | None, bytes | None, bytes | None]]


def _options(shm_bytes: int) -> WorkerOptions:
    return WorkerOptions(EngineSettings(n_ctx=320, n_slots=3, n_spare=1, n_threads=2), shm_bytes=shm_bytes)


def run(shm_bytes: int, test: Callable[[WorkerClient], Awaitable[None]], restart: bool = False) -> None:
    async def main() -> None:
        client = WorkerClient(_options(shm_bytes), restart=restart)
        await client.start()
        try:
            await test(client)
        finally:
            await client.close()

    asyncio.run(main())


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


async def _open(c: WorkerClient, seq: int, text: str, cap: CaptureOptions, n: int = 8) -> GenerationStream:
    ids = (await c.tokenize(text, True, False)).ids
    return await c.generate(GenerationJob(seq=seq, input_ids=ids, params=_params(n), capture=cap))


async def _collect(stream: GenerationStream) -> list[TokenOutput]:
    """Every token, its views held until the end (a range reused while held would show in the rows)."""
    return [ev async for ev in stream if isinstance(ev, TokenOutput)]


async def _collect_rows(stream: GenerationStream) -> Rows:
    """Every token's bytes, each token's views held until the end and then dropped."""
    return _rows(await _collect(stream))


def _bytes(b: bytes | None) -> bytes | None:
    return bytes(b) if b is not None else None


def _rows(tokens: list[TokenOutput]) -> Rows:
    return [(t.token.token_id, _bytes(t.attention), _bytes(t.hidden), _bytes(t.positions)) for t in tokens]


async def _settled(c: WorkerClient) -> proto.EngineState:
    """The engine's state once every range the orchestrator released has reached the worker."""
    state = await c.engine_state()
    for _ in range(200):
        if state.shm_free == state.shm_bytes:
            break
        await asyncio.sleep(0.02)
        state = await c.engine_state()
    return state


async def _one_by_one(c: WorkerClient) -> list[Rows]:
    out = []
    for seq, (text, cap) in enumerate(zip(PROMPTS, (FULL, HALF, TOPK), strict=True)):
        tokens = await _collect(await _open(c, seq, text, cap))
        assert tokens and all(t.attention is not None for t in tokens)
        out.append(_rows(tokens))
        await c.erase(seq)
    return out


def test_rows_through_shared_memory_equal_the_sockets_bit_for_bit() -> None:
    got: dict[int, list[Rows]] = {}

    def with_(shm: int) -> Callable[[WorkerClient], Awaitable[None]]:
        async def test(c: WorkerClient) -> None:
            got[shm] = await _one_by_one(c)
            state = await _settled(c)
            assert state.shm_bytes == shm and state.shm_free == shm  # every range came back
            n = sum(len(r) for r in got[shm])
            assert (state.shm_frames, state.inline_frames) == ((n, 0) if shm else (0, 0))

        return test

    run(64 << 20, with_(64 << 20))
    run(0, with_(0))
    assert got[64 << 20] == got[0]


def test_several_streams_at_once_and_one_that_stops_reading() -> None:
    async def test(c: WorkerClient) -> None:
        alone = await _one_by_one(c)  # each stream's rows, generated alone
        stalled = await _open(c, 2, PROMPTS[2], FULL, n=40)  # never read while the others run
        first = await stalled.__anext__()  # the worker has started it
        assert isinstance(first, TokenOutput)
        together = await asyncio.gather(
            _collect_rows(await _open(c, 0, PROMPTS[0], FULL)), _collect_rows(await _open(c, 1, PROMPTS[1], HALF))
        )
        assert together == alone[:2]  # batched together, each stream's rows are those it has alone
        await asyncio.sleep(0)  # the releases of the views dropped go out (before the next request)
        state = await c.engine_state()
        assert state.inline_frames == 0
        held = state.shm_bytes - state.shm_free  # what the stalled stream holds: its window
        assert first.token.attention is not None
        n_layers, n_heads, _ = first.token.attention.shape
        largest = first.nbytes + c.window * n_layers * n_heads * 4 + 2 * ALIGN  # a token is a position longer
        assert first.nbytes * c.window <= held <= c.window * largest
        del first
        await stalled.aclose()  # the client went away: the tokens it held go back
        state = await _settled(c)
        assert state.shm_free == state.shm_bytes and state.generating == []

    run(64 << 20, test)


def test_a_full_region_falls_back_to_the_socket() -> None:
    """A region that holds about one token: the decode loop never waits for room, the rest go inline."""
    reference: list[list[Rows]] = []
    run(0, lambda c: _store(reference, _one_by_one(c)))

    async def test(c: WorkerClient) -> None:
        tokens = await _collect(await _open(c, 0, PROMPTS[0], FULL))  # held to the end: the region fills
        kinds = {type(t.attention).__name__ for t in tokens}
        state = await c.engine_state()
        assert state.shm_frames >= 1 and state.inline_frames >= 1 and kinds == {"memoryview", "bytearray"}
        assert _rows(tokens) == reference[0][0]
        del tokens
        assert (await _settled(c)).shm_free == 256 << 10

    run(256 << 10, test)


async def _store(into: list[list[Rows]], rows: Awaitable[list[Rows]]) -> None:
    into.append(await rows)


def test_a_restarted_worker_gets_a_region_of_its_own() -> None:
    """Views lent before a worker crash keep their bytes: the new worker writes into a new region."""

    async def test(c: WorkerClient) -> None:
        stream = await _open(c, 0, PROMPTS[0], FULL, n=30)
        first = await stream.__anext__()
        assert isinstance(first, TokenOutput) and isinstance(first.attention, memoryview)
        before = bytes(first.attention)
        assert c.pid is not None
        os.kill(c.pid, signal.SIGKILL)
        for _ in range(1200):  # the client notices, and starts a new worker
            if c.alive and c.generation == 2:
                break
            await asyncio.sleep(0.1)
        assert c.alive and c.generation == 2
        again = await _collect_rows(await _open(c, 1, PROMPTS[1], FULL))
        assert again and bytes(first.attention) == before
        await stream.aclose()
        assert (await _settled(c)).shm_free == 64 << 20

    run(64 << 20, test, restart=True)


def test_a_tcp_worker_sends_its_tensors_inline() -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "engine.worker", "--listen", f"tcp:127.0.0.1:{port}", "-c", "256", "-np", "1"]
    proc = subprocess.Popen([*cmd, "--spare", "1", "-t", "2"], cwd=ROOT)
    try:

        async def main() -> None:
            client = WorkerClient(WorkerOptions(connect=f"tcp:127.0.0.1:{port}"), restart=False)
            for _ in range(100):  # the worker opens its port before it loads the model
                try:
                    await client.start()
                    break
                except OSError:
                    await asyncio.sleep(0.2)
            try:
                tokens = await _collect(await _open(client, 0, PROMPTS[1], FULL, n=3))
                assert tokens and all(isinstance(t.attention, bytearray) for t in tokens)
                state = await client.engine_state()
                assert (state.shm_bytes, state.shm_frames, state.inline_frames) == (0, 0, 0)
            finally:
                await client.close()

        asyncio.run(main())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
