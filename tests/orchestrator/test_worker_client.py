"""Every method of the EngineClient protocol against a real worker process (``WorkerClient``), and its refusals."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from contract import protocol as proto
from contract.errors import ErrorCode
from contract.flow import WINDOW_TOKENS
from contract.options import CaptureOptions, SamplingParams
from contract.settings import EngineSettings
from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import EngineRequestError, GenerationJob, GenerationStream, TokenOutput
from orchestrator.engine_client.launch import WorkerOptions
from tests.conftest import ROOT
from tests.redis_server import free_port

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
ATTENTION = CaptureOptions(attention=True, format="per_layer", dtype="float16", hidden_state=True)


def run(test: Callable[[WorkerClient], Awaitable[None]]) -> None:
    """Start a small worker, run ``test`` on its client, and stop it (the worker answers ``Shutdown``)."""

    async def main() -> None:
        client = WorkerClient(
            WorkerOptions(EngineSettings(n_ctx=256, n_slots=2, n_spare=1, n_threads=2)), restart=False
        )
        await client.start()
        try:
            await test(client)
        finally:
            reply, _ = await client._request(proto.Shutdown(client.new_id()), proto.Stopped)
            assert isinstance(reply, proto.Stopped)
            await client.close()

    asyncio.run(main())


async def collect(stream: GenerationStream) -> tuple[list[TokenOutput], proto.Done]:
    tokens: list[TokenOutput] = []
    async for ev in stream:
        if isinstance(ev, TokenOutput):
            tokens.append(ev)
        elif isinstance(ev, proto.Done):
            return tokens, ev
    raise AssertionError("no Done")


def test_every_method_over_a_real_worker() -> None:
    async def test(c: WorkerClient) -> None:
        assert c.info is not None and c.alive and c.generation == 1
        ids = (await c.tokenize("Hello there, how are you?", True, False)).ids
        assert await c.detokenize(ids) == "Hello there, how are you?"
        tokens, done = await collect(
            await c.generate(GenerationJob(seq=0, input_ids=ids, params=GREEDY, capture=ATTENTION))
        )
        assert done.finish_reason == "length" and len(tokens) == 4 and done.seq_tokens == len(ids) + 4
        first = tokens[0]
        att = first.token.attention
        assert (
            att is not None
            and att.dtype == "float16"
            and att.shape == (c.info.num_layers, c.info.num_attention_heads, len(ids))
        )
        rows = np.frombuffer(first.attention or b"", dtype=att.dtype).reshape(att.shape)
        assert np.allclose(rows.astype(np.float32).sum(axis=-1), 1.0, atol=1e-2)
        assert first.token.hidden is not None and first.token.hidden.shape == (c.info.hidden_size,)
        assert len(first.hidden or b"") == 4 * c.info.hidden_size
        generated = [t.token.token_id for t in tokens]
        assert await c.tokens(0) == ids + generated
        # preview on a fork: the slot is untouched
        _, pdone = await collect(await c.preview(0, [], ids[:2], GREEDY, CaptureOptions()))
        assert pdone.n_cached == len(ids) + 4 and await c.tokens(0) == ids + generated
        _, pdone = await collect(await c.preview(None, ids, [], GREEDY, CaptureOptions()))
        assert pdone.n_generated == 4
        assert await c.fork(0, 1) == ids + generated
        assert await c.truncate(1, 3) == ids[:3]
        assert await c.context_shift(0, 1, 2) == [ids[0], *ids[3:], *generated]
        saved = await c.save_state(0)
        assert saved.tokens == await c.tokens(0) and len(saved.state) > 0
        await c.erase(1)
        assert await c.tokens(1) == []
        assert await c.restore_state(1, saved.tokens, saved.state) >= 0
        assert await c.tokens(1) == saved.tokens
        state = await c.engine_state()
        assert state.generating == []
        # a stream closed before its first event (the client left at once) still cancels its generation
        long = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
        stream = await c.generate(GenerationJob(seq=0, input_ids=ids, params=long, capture=CaptureOptions()))
        await stream.aclose()
        assert (await c.engine_state()).generating == [] and not c._pending

    run(test)


def test_a_stream_not_read_holds_its_generation() -> None:
    """Flow control: the worker emits ``WINDOW_TOKENS`` tokens ahead of what the stream's consumer
    took, then holds that generation; asking for more acknowledges, and leaving ends it."""

    async def test(c: WorkerClient) -> None:
        assert c.window == WINDOW_TOKENS
        ids = (await c.tokenize("Once upon a time", True, False)).ids
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        stream = await c.generate(GenerationJob(seq=0, input_ids=ids, params=params, capture=CaptureOptions()))
        first = await anext(stream)  # taken, not yet acknowledged (that comes with the next ask)
        assert isinstance(first, TokenOutput) and first.token.index == 0
        queue = c._pending.queue_of(stream.req)
        assert queue is not None
        deadline = asyncio.get_running_loop().time() + 60
        while queue.qsize() < WINDOW_TOKENS - 1:  # the rest of the window arrives
            assert asyncio.get_running_loop().time() < deadline, f"{queue.qsize()} tokens queued"
            await asyncio.sleep(0.01)
        for _ in range(2):  # two round trips: the worker had a step in between, and did not decode it
            await c.tokenize("x", False, False)
        assert queue.qsize() == WINDOW_TOKENS - 1 and (await c.engine_state()).generating == [0]
        tokens, done = await collect(stream)  # each ask acknowledges the token before it
        assert done.finish_reason == "length" and 1 + len(tokens) == 24
        assert [t.token.index for t in tokens] == list(range(1, 24))
        await stream.aclose()
        # a held stream whose consumer leaves is cancelled at once
        held = await c.generate(GenerationJob(seq=1, input_ids=ids, params=params, capture=CaptureOptions()))
        await anext(held)
        await held.aclose()
        assert (await c.engine_state()).generating == [] and not c._pending

    run(test)


def test_refusals_carry_their_error_code() -> None:
    async def test(c: WorkerClient) -> None:
        ids = (await c.tokenize("Hi", True, False)).ids
        cases = [
            (c.tokens(7), ErrorCode.INVALID_REQUEST),  # not a slot's sequence
            (c.context_shift(0, 0, 5), ErrorCode.INVALID_REQUEST),  # nothing to shift
            (c.restore_state(0, ids, b"not a llama.cpp state"), ErrorCode.BAD_STATE),
            (c.classify(["x"]), ErrorCode.INVALID_REQUEST),  # a generation worker has no classifier
        ]
        for call, code in cases:
            with pytest.raises(EngineRequestError) as exc:
                await call
            assert exc.value.code is code, exc.value
        with pytest.raises(EngineRequestError) as exc:
            await collect(
                await c.generate(
                    GenerationJob(
                        seq=0,
                        input_ids=ids,
                        params=SamplingParams(max_new_tokens=1000),
                        capture=CaptureOptions(),
                    )
                )
            )
        assert exc.value.code is ErrorCode.CONTEXT_OVERFLOW
        # a buffer that does not match its description is refused, and the worker goes on
        msg = proto.RestoreState(c.new_id(), 0, ids, proto.Tensor(0, "uint8", (100,)))
        with pytest.raises(EngineRequestError, match="needs 100") as exc:
            await c._request(msg, proto.StateRestored, [b"short"])
        assert exc.value.code is ErrorCode.INVALID_REQUEST
        msg = proto.RestoreState(c.new_id(), 0, ids, proto.Tensor(0, "float32", (2,)))
        with pytest.raises(EngineRequestError) as exc:
            await c._request(msg, proto.StateRestored, [b"12345678"])
        assert exc.value.code is ErrorCode.BAD_STATE
        assert (await c.tokenize("still here", False, False)).ids

    run(test)


def test_a_standalone_worker_takes_the_engine_flags() -> None:
    """``python -m engine.worker --listen tcp:...`` with llama-server's flags, reached by ``WorkerOptions.connect``."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine.worker", "--listen", f"tcp:127.0.0.1:{port}"]
    proc = subprocess.Popen([*cmd, "-c", "320", "-np", "1", "--spare", "1", "-t", "2"], cwd=ROOT)
    try:

        async def main() -> None:
            client = WorkerClient(WorkerOptions(connect=f"tcp:127.0.0.1:{port}"), restart=False)
            for _ in range(100):  # the worker opens its port before it loads the model
                try:
                    info = await client.start()
                    break
                except OSError:
                    await asyncio.sleep(0.2)
            else:
                raise AssertionError("the standalone worker did not listen")
            try:
                assert (info.n_ctx, info.n_slots, info.runtime.n_threads) == (320, 1, 2)
                assert (await client.tokenize("hi", False, False)).ids
            finally:
                await client.close()

        asyncio.run(main())
        assert proc.wait(30) == 0  # Shutdown answered, then a clean exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_spawned_worker_runs_this_checkout() -> None:
    """The worker's ``PYTHONPATH`` starts with the checkout's root, so an interpreter that has no slotserve
    installed (another virtual environment's, ``SLOTSERVE_WORKER_PYTHON``) imports this checkout's worker;
    run here without site-packages (``-S``: no editable install to fall back on)."""
    env = WorkerOptions(extra_env={"PYTHONPATH": "/nonexistent"}).env()
    assert env["PYTHONPATH"].split(":") == [str(ROOT), "/nonexistent"]
    probe = "import importlib.util as u; print(u.find_spec('engine.worker').origin)"
    out = subprocess.run(
        [sys.executable, "-S", "-c", probe], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(ROOT / "engine" / "worker.py")
