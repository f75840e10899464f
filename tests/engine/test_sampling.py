"""Sampling through llama.cpp's chain: banned tokens, stops, seeds, logprobs."""

from __future__ import annotations

import math

import pytest

from contract.options import CaptureOptions
from tests.conftest import CHAT
from tests.engine.enginekit import Runner

NO_CAPTURE = CaptureOptions(attention=False)


@pytest.fixture(scope="module")
def runner(engine):  # type: ignore[no-untyped-def]
    return Runner(engine)


@pytest.fixture(scope="module")
def prompt(model) -> list[int]:  # type: ignore[no-untyped-def]
    return model.tokenize(CHAT.format("What is the capital of France?"), False, True)


def gen(runner: Runner, prompt: list[int], **kw: object):  # type: ignore[no-untyped-def]
    runner.engine.erase(0)
    kw.setdefault("capture", NO_CAPTURE)
    return runner.generate(0, prompt, **kw)


def test_greedy_answer_and_stop_at_end_of_turn(runner: Runner, prompt: list[int], model) -> None:  # type: ignore[no-untyped-def]
    res = gen(runner, prompt, max_new_tokens=40)
    assert res.done is not None and res.done.finish_reason == "stop_token"
    assert res.tokens[-1] in model.eog
    assert "Paris" in model.detokenize(res.tokens)


def test_banned_tokens_never_appear(runner: Runner, prompt: list[int], model) -> None:  # type: ignore[no-untyped-def]
    first = gen(runner, prompt, max_new_tokens=20, ignore_eos=True)
    banned = sorted(set(first.tokens[:6]))  # the tokens greedy wanted most
    res = gen(runner, prompt, max_new_tokens=20, ignore_eos=True, banned_tokens=banned)
    assert len(res.tokens) == 20
    assert not set(res.tokens) & set(banned)
    # Also under random sampling with a high temperature.
    hot = gen(runner, prompt, max_new_tokens=30, ignore_eos=True, banned_tokens=banned, temperature=1.5, seed=7)
    assert not set(hot.tokens) & set(banned)


def test_stop_token_ends_generation(runner: Runner, prompt: list[int]) -> None:
    first = gen(runner, prompt, max_new_tokens=10, ignore_eos=True)
    stop = first.tokens[3]
    res = gen(runner, prompt, max_new_tokens=10, ignore_eos=True, stop_tokens=[stop])
    assert res.done is not None and res.done.finish_reason == "stop_token"
    assert res.tokens == first.tokens[: first.tokens.index(stop) + 1]


def test_stop_string_ends_generation(runner: Runner, prompt: list[int], model) -> None:  # type: ignore[no-untyped-def]
    first = gen(runner, prompt, max_new_tokens=10, ignore_eos=True)
    text = model.detokenize(first.tokens)
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    res = gen(runner, prompt, max_new_tokens=10, ignore_eos=True, stop_strings=[needle])
    assert res.done is not None and res.done.finish_reason == "stop_string"
    assert res.done.stop_string == needle
    got = model.detokenize(res.tokens)
    assert needle in got and got.index(needle) + len(needle) > len(got) - 8
    assert len(res.tokens) < 10


def test_length_limit(runner: Runner, prompt: list[int]) -> None:
    res = gen(runner, prompt, max_new_tokens=3, ignore_eos=True)
    assert len(res.tokens) == 3 and res.done is not None and res.done.finish_reason == "length"


def test_seeded_sampling_is_reproducible(runner: Runner, prompt: list[int]) -> None:
    a = gen(runner, prompt, max_new_tokens=16, ignore_eos=True, temperature=1.2, seed=1234, top_k=0, top_p=1.0)
    b = gen(runner, prompt, max_new_tokens=16, ignore_eos=True, temperature=1.2, seed=1234, top_k=0, top_p=1.0)
    c = gen(runner, prompt, max_new_tokens=16, ignore_eos=True, temperature=1.2, seed=99, top_k=0, top_p=1.0)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_logprobs_and_top_logprobs(runner: Runner, prompt: list[int]) -> None:
    res = gen(runner, prompt, max_new_tokens=5, ignore_eos=True, logprobs=True, n_probs=5)
    for ev in res.events:
        assert ev.logprob is not None and ev.logprob <= 0
        assert len(ev.top) == 5
        lps = [lp for _, lp in ev.top]
        assert lps == sorted(lps, reverse=True)
        assert ev.top[0][0] == ev.token_id  # greedy picks the most likely token
        assert math.isclose(ev.top[0][1], ev.logprob, abs_tol=1e-5)
        assert sum(math.exp(lp) for lp in lps) <= 1 + 1e-5


def test_repetition_penalty_changes_output(runner: Runner, prompt: list[int]) -> None:
    plain = gen(runner, prompt, max_new_tokens=40, ignore_eos=True)
    pen = gen(runner, prompt, max_new_tokens=40, ignore_eos=True, repeat_penalty=1.8)
    assert plain.tokens != pen.tokens
    assert len(set(pen.tokens)) >= len(set(plain.tokens))
