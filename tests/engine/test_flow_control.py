"""Flow control (``Generate.window``, ``window_bytes`` / ``Ack``): a job whose client lags is held,
the others go on."""

from __future__ import annotations

import pytest

from contract.options import CaptureOptions, SamplingParams
from contract.protocol import Generate
from tests.engine.enginekit import Runner

PROMPT = [1, 2, 3, 4, 5, 6]


def _generate(
    runner: Runner, req: int, seq: int, window: int, window_bytes: int = 0, capture: CaptureOptions | None = None
) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    cap = capture or CaptureOptions()
    runner.batcher.submit(Generate(req, seq, "generate", PROMPT, params, cap, window=window, window_bytes=window_bytes))


def test_held_job_waits_for_ack_while_others_go_on(runner: Runner) -> None:
    slow, fast = 7_000_001, 7_000_002
    _generate(runner, slow, 0, window=2)
    _generate(runner, fast, 1, window=0)
    runner.run()  # runs until nothing but the held job is left
    assert runner.results[fast].done is not None and len(runner.results[fast].tokens) == 6
    assert len(runner.results[slow].tokens) == 2 and runner.results[slow].done is None
    assert not runner.batcher.has_work()  # held: the worker would block on its inbox, not spin
    runner.batcher.ack(slow, 1)
    runner.run()
    assert len(runner.results[slow].tokens) == 3  # one more token per token taken
    runner.batcher.ack(slow, 6)  # more than it emitted: taken are the 3 it has, no credit in advance
    runner.run()
    assert len(runner.results[slow].tokens) == 5
    runner.batcher.ack(slow, 5)
    runner.run()
    done = runner.results[slow].done
    assert done is not None and done.finish_reason == "length" and len(runner.results[slow].tokens) == 6
    # the held generation is the same as an unheld one (greedy)
    assert runner.results[slow].tokens == runner.results[fast].tokens


def test_cancel_ends_a_held_job(runner: Runner) -> None:
    req = 7_000_003
    _generate(runner, req, 0, window=1)
    runner.run()
    assert len(runner.results[req].tokens) == 1 and not runner.batcher.has_work()
    runner.batcher.cancel(req)
    assert runner.batcher.has_work()
    runner.run()
    done = runner.results[req].done
    assert done is not None and done.finish_reason == "cancelled"


def test_a_byte_window_holds_a_job_by_the_size_of_its_attention(runner: Runner) -> None:
    """``window_bytes``: a token is emitted while less than that many tensor bytes are outstanding,
    so with 1.5 frames' worth the job holds after two frames, and a single frame always goes."""
    if not runner.engine.attention_layers:
        pytest.skip("a recurrent model has no attention to capture")
    cap = CaptureOptions(attention=True, format="per_layer", dtype="float32")
    probe = 7_000_004
    _generate(runner, probe, 0, window=1, capture=cap)
    runner.run()
    frame = runner.results[probe].attention[0].nbytes  # the first token's attention row, float32
    runner.batcher.cancel(probe)
    runner.run()
    req, tiny = 7_000_005, 7_000_006
    _generate(runner, req, 0, window=0, window_bytes=frame * 3 // 2, capture=cap)
    _generate(runner, tiny, 1, window=0, window_bytes=1, capture=cap)  # smaller than one frame
    runner.run()
    assert len(runner.results[req].tokens) == 2 and not runner.batcher.has_work()
    assert len(runner.results[tiny].tokens) == 1  # one token outstanding at a time, never none
    runner.batcher.ack(req, 2)
    runner.batcher.ack(tiny, 1)
    runner.run()
    assert len(runner.results[req].tokens) == 4 and len(runner.results[tiny].tokens) == 2
    runner.batcher.ack(req, 1)  # an older count changes nothing
    runner.run()
    assert len(runner.results[req].tokens) == 4
    for r in (req, tiny):
        while runner.results[r].done is None:
            runner.batcher.ack(r, len(runner.results[r].tokens))
            runner.run()
        done = runner.results[r].done
        assert done is not None and done.finish_reason == "length" and len(runner.results[r].tokens) == 6
