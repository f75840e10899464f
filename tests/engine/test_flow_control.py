"""Flow control (``Generate.window`` / ``Ack``): a job whose client lags is held, the others go on."""

from __future__ import annotations

from engine.protocol import CaptureOptions, Generate, SamplingParams
from tests.engine.enginekit import Runner

PROMPT = [1, 2, 3, 4, 5, 6]


def _generate(runner: Runner, req: int, seq: int, window: int) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    runner.batcher.submit(Generate(req, seq, "generate", PROMPT, params, CaptureOptions(), window=window))


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
    runner.batcher.ack(slow, 6)
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
