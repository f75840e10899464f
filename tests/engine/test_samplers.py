"""llama-server's further samplers on the real model: grammar, JSON schema, logit bias,
presence/frequency penalties, DRY, XTC, typical, top-n-sigma, Mirostat, and the chain order."""

from __future__ import annotations

import json

import llama_cpp as llama
import msgspec
import numpy as np
import pytest

from contract.options import CaptureOptions, SamplingParams
from engine.grammar import JSON_GBNF, MAX_NESTING, nesting_depth
from engine.sampling import SamplerChain, stage_names
from tests.conftest import CHAT
from tests.engine.enginekit import Result, Runner

NO_CAPTURE = CaptureOptions(attention=False)
YES_NO = 'root ::= "yes" | "no"'
# llama-server's default order (common/common.h ``samplers``), the logit bias before it
LLAMA_SERVER_ORDER = ["logit-bias", "penalties", "dry", "top-n-sigma", "top-k", "typical", "top-p", "min-p", "xtc",
                      "temp", "dist"]  # fmt: skip


@pytest.fixture(scope="module")
def runner(engine):  # type: ignore[no-untyped-def]
    return Runner(engine)


@pytest.fixture(scope="module")
def question(model) -> list[int]:  # type: ignore[no-untyped-def]
    return model.tokenize(CHAT.format("Is Paris in France? Answer yes or no."), False, True)


@pytest.fixture(scope="module")
def repetitive(model) -> list[int]:  # type: ignore[no-untyped-def]
    return model.tokenize("one two three one two three one two three one two three one", False, True)


def gen(runner: Runner, prompt: list[int], **kw: object) -> Result:
    runner.engine.erase(0)
    kw.setdefault("capture", NO_CAPTURE)
    return runner.generate(0, prompt, **kw)


def chain_names(params: SamplingParams, model) -> list[str]:  # type: ignore[no-untyped-def]
    """The names llama.cpp gives the samplers of the chain built for ``params``."""
    chain = SamplerChain(params, model.vocab, model.n_vocab)
    try:
        n = llama.llama_sampler_chain_n(chain.ptr)
        return [llama.llama_sampler_name(llama.llama_sampler_chain_get(chain.ptr, i)).decode() for i in range(n)]
    finally:
        chain.close()


def test_chain_order_is_llama_servers(model) -> None:  # type: ignore[no-untyped-def]
    every = SamplingParams(temperature=0.8, repeat_penalty=1.1, presence_penalty=0.5, dry_multiplier=0.8,
                           top_n_sigma=1.5, typical_p=0.9, xtc_probability=0.5, logit_bias=[(5, 1.0)])  # fmt: skip
    got = [n.lstrip("?") for n in chain_names(every, model)]  # llama.cpp names the logit bias "?logit-bias"
    assert got == LLAMA_SERVER_ORDER == stage_names(every)
    chain = SamplerChain(msgspec.structs.replace(every, grammar=YES_NO), model.vocab, model.n_vocab)
    try:  # the grammar is kept beside the chain, as llama-server keeps it
        assert llama.llama_sampler_name(chain.grammar) == b"grammar"
        assert llama.llama_sampler_chain_n(chain.ptr) == len(LLAMA_SERVER_ORDER)
    finally:
        chain.close()
    miro = msgspec.structs.replace(every, mirostat=2)
    assert [n.lstrip("?") for n in chain_names(miro, model)] == [
        "logit-bias",
        "penalties",
        "dry",
        "temp",
        "mirostat-v2",
    ]
    assert chain_names(msgspec.structs.replace(every, mirostat=1), model)[-1] == "mirostat"
    greedy = msgspec.structs.replace(every, temperature=0.0)
    assert [n.lstrip("?") for n in chain_names(greedy, model)] == ["logit-bias", "penalties", "dry", "typical", "xtc",
                                                                    "greedy"]  # fmt: skip
    assert chain_names(SamplingParams(temperature=0.0), model) == ["greedy"]  # the defaults add nothing
    assert chain_names(msgspec.structs.replace(every, dynatemp_range=0.5), model)[-2:] == ["temp-ext", "dist"]


@pytest.mark.parametrize("seed", [-1, 1, 2])
def test_grammar_allows_only_its_words(runner: Runner, question: list[int], model, seed: int) -> None:  # type: ignore[no-untyped-def]
    res = gen(runner, question, max_new_tokens=8, grammar=YES_NO, temperature=1.5, top_k=0, top_p=1.0, seed=seed)
    assert res.error is None and res.done is not None
    assert res.done.finish_reason == "stop_token"  # complete: only the end of generation is allowed
    assert model.detokenize([t for t in res.tokens if t not in model.eog]) in ("yes", "no")


def test_grammar_without_an_allowed_end_stops_cleanly(runner: Runner, question: list[int], model) -> None:  # type: ignore[no-untyped-def]
    """The grammar is complete but end-of-generation tokens are banned: nothing may follow, the
    generation ends there (llama.cpp would abort the process if a refused token were accepted)."""
    res = gen(runner, question, max_new_tokens=8, grammar=YES_NO, banned_tokens=sorted(model.eog))
    assert res.error is None and res.done is not None and res.done.finish_reason == "stop_token"
    assert model.detokenize(res.tokens) in ("yes", "no")
    again = gen(runner, question, max_new_tokens=4)  # the worker still works
    assert again.done is not None and again.tokens


def test_json_schema_output_parses_and_matches(runner: Runner, model) -> None:  # type: ignore[no-untyped-def]
    class Answer(msgspec.Struct, forbid_unknown_fields=True):
        city: str
        population: int

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
              "population": {"type": "integer"}}, "required": ["city", "population"]}  # fmt: skip
    prompt = model.tokenize(CHAT.format("Give the capital of France and its population as JSON."), False, True)
    res = gen(runner, prompt, max_new_tokens=60, json_schema=json.dumps(schema))
    assert res.done is not None and res.done.finish_reason == "stop_token", model.detokenize(res.tokens)
    text = model.detokenize([t for t in res.tokens if t not in model.eog])
    answer = msgspec.json.decode(text, type=Answer)  # raises unless the schema holds
    assert answer.city
    prompt = model.tokenize(CHAT.format('Repeat this JSON exactly: {"answer": "yes"}'), False, True)
    res = gen(runner, prompt, max_new_tokens=30, grammar=JSON_GBNF)  # any JSON object (response_format json_object)
    text = model.detokenize([t for t in res.tokens if t not in model.eog])
    assert res.done is not None and res.done.finish_reason == "stop_token", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("grammar", "schema"),
    [
        ('root ::= "yes', ""),  # unterminated literal
        ("root ::= answer", ""),  # undefined rule
        ('root ::= root "a" | "a"', ""),  # left recursion
        ('answer ::= "a"', ""),  # no root
        ("root ::= " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1), ""),  # would overflow the stack
        ("", "{not json"),
        ("", '{"type": "array", "maxItems": 100000}'),
        ("", '{"type": "string", "pattern": "a{0,99999}"}'),
        ("", '{"$ref": "#/definitions/missing"}'),
        ("", '{"items": ' * 5000 + "{}" + "}" * 5000),  # deeper than Python's recursion limit
        ('root ::= "a"\x00 junk', ""),  # C would read the grammar up to the NUL
    ],
)
def test_bad_grammar_is_refused_and_the_sequence_kept(runner: Runner, question: list[int], grammar: str, schema: str) -> None:  # fmt: skip
    runner.engine.erase(0)
    first = runner.generate(0, question, max_new_tokens=3, capture=NO_CAPTURE)
    assert first.done is not None
    before = list(runner.engine.tokens.get(0, []))
    res = runner.generate(0, [*question, 11, 12], max_new_tokens=3, capture=NO_CAPTURE, grammar=grammar,
                          json_schema=schema)  # fmt: skip
    assert res.error is not None and res.error.code == "INVALID_GRAMMAR", res
    assert runner.engine.tokens.get(0, []) == before


def test_nesting_depth_skips_literals_and_comments() -> None:
    assert nesting_depth('root ::= ("(" ([a-z(] "\\"(")) # (((') == 2
    assert nesting_depth(JSON_GBNF) == 2


def test_logit_bias_bans_and_forces(runner: Runner, question: list[int]) -> None:
    plain = gen(runner, question, max_new_tokens=6, ignore_eos=True)
    top = plain.tokens[0]
    banned = gen(runner, question, max_new_tokens=6, ignore_eos=True, logit_bias=[(top, float("-inf"))])
    assert top not in banned.tokens
    forced = gen(runner, question, max_new_tokens=6, ignore_eos=True, logit_bias=[(42, 100.0)])
    assert forced.tokens == [42] * 6
    hot = gen(runner, question, max_new_tokens=6, ignore_eos=True, logit_bias=[(42, 100.0)], temperature=1.0, seed=3)
    assert hot.tokens == [42] * 6


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_break_repetition(runner: Runner, repetitive: list[int], model, field: str) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    plain = gen(runner, repetitive, max_new_tokens=12, ignore_eos=True)
    pen = gen(runner, repetitive, max_new_tokens=12, ignore_eos=True, **{field: 1.5})
    assert "two three" in model.detokenize(plain.tokens)  # greedy keeps the pattern going
    assert pen.tokens != plain.tokens
    # penalised: the context's words are pushed down, so greedy no longer picks " two" next
    assert pen.tokens[0] != plain.tokens[0]


def test_dry_breaks_repetition(runner: Runner, repetitive: list[int], model) -> None:  # type: ignore[no-untyped-def]
    plain = gen(runner, repetitive, max_new_tokens=12, ignore_eos=True)
    dry = gen(runner, repetitive, max_new_tokens=12, ignore_eos=True, dry_multiplier=2.0, dry_allowed_length=1)
    assert dry.tokens != plain.tokens
    assert "one two three one two" not in model.detokenize(dry.tokens)


@pytest.mark.parametrize(
    "kw",
    [
        {"mirostat": 1},
        {"mirostat": 2, "mirostat_tau": 3.0},
        {"xtc_probability": 1.0, "xtc_threshold": 0.05},
        {"typical_p": 0.5},
        {"top_n_sigma": 1.0},
        {"dynatemp_range": 0.5, "dynatemp_exponent": 1.5},
    ],
)
def test_seeded_samplers_are_reproducible(runner: Runner, question: list[int], kw: dict[str, object]) -> None:
    common = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    a = gen(runner, question, seed=11, **common, **kw)
    b = gen(runner, question, seed=11, **common, **kw)
    assert a.error is None and len(a.tokens) == 12
    assert a.tokens == b.tokens
    others = [gen(runner, question, seed=s, **common, **kw).tokens for s in (12, 13, 14)]
    assert any(t != a.tokens for t in others)  # the seed matters: it is sampling, not greedy


def test_post_sampling_probs_are_the_chains(runner: Runner, question: list[int], model) -> None:  # type: ignore[no-untyped-def]
    """llama-server's ``post_sampling_probs``: at temperature 1 with top-k 10 (top-p and min-p off) the chain
    keeps the 10 most likely tokens and ``dist`` gives them a softmax of their logits; ``top_probs`` are
    those 10, summing to 1, and the sampled token's ``prob`` is its own among them."""
    hot = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 1.0, "top_k": 10, "top_p": 1.0, "min_p": 0.0}
    raw = gen(runner, question, n_probs=10, logprobs=True, seed=5, **hot)  # the model's own top 10 (logprobs)
    post = gen(runner, question, n_probs=10, logprobs=True, post_sampling_probs=True, seed=5, **hot)
    assert raw.error is None and post.error is None and len(post.events) == 3
    assert post.tokens == raw.tokens  # the same seeded chain picks the same tokens through either path
    assert raw.events[0].prob is None and raw.events[0].top_probs == [] and len(raw.events[0].top) == 10
    first = post.events[0]
    assert first.top == []  # top_probs instead
    ids = [t for t, _ in raw.events[0].top]
    lps = np.array([lp for _, lp in raw.events[0].top])
    softmax = np.exp(lps - lps.max()) / np.exp(lps - lps.max()).sum()  # logprob differences are logit differences
    assert [t for t, _ in first.top_probs] == ids  # best first
    assert np.allclose([p for _, p in first.top_probs], softmax, atol=1e-5)
    for ev in post.events:
        assert len(ev.top_probs) == 10 and sum(p for _, p in ev.top_probs) == pytest.approx(1.0, abs=1e-5)
        assert ev.prob is not None and 0 < ev.prob <= 1
        assert dict(ev.top_probs)[ev.token_id] == pytest.approx(ev.prob)
    few = gen(runner, question, n_probs=3, post_sampling_probs=True, seed=5, **hot)
    assert few.events[0].top_probs == first.top_probs[:3]


def test_post_sampling_probs_greedy_and_grammar(runner: Runner, question: list[int], model) -> None:  # type: ignore[no-untyped-def]
    """Greedy (temperature 0): llama-server's chain (temperature 0, then ``dist``) leaves the pick at
    probability 1 and every other token at 0, which are left out; the grammar path keeps its candidates too."""
    plain = gen(runner, question, max_new_tokens=4, ignore_eos=True)
    greedy = gen(runner, question, max_new_tokens=4, ignore_eos=True, n_probs=5, post_sampling_probs=True)
    assert greedy.tokens == plain.tokens  # the candidate-array path picks what llama_sampler_sample picks
    for ev in greedy.events:
        assert ev.prob == 1.0 and ev.top_probs == [(ev.token_id, 1.0)]
    res = gen(runner, question, max_new_tokens=8, grammar=YES_NO, temperature=1.0, seed=3, n_probs=5,
              post_sampling_probs=True)  # fmt: skip
    assert res.done is not None and res.done.finish_reason == "stop_token"
    assert model.detokenize([t for t in res.tokens if t not in model.eog]) in ("yes", "no")
    for ev in res.events:
        assert ev.prob is not None and 0 < ev.prob <= 1 and 0 < len(ev.top_probs) <= 5
        assert all(p > 0 for _, p in ev.top_probs) and sum(p for _, p in ev.top_probs) <= 1 + 1e-5
