"""Each tool-call format's grammar on the real default model's vocabulary: llama.cpp accepts it (GBNF wrapper
and the tools' JSON schemas), and a lazy grammar (``tool_choice: auto``) constrains only from its trigger on."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.generation.tool_plan import plan_of
from tests.orchestrator.tool_call_cases import ADD, QWEN25, WEATHER


@pytest.mark.parametrize("template", [QWEN25, "[TOOL_CALLS]", "<|start_header_id|>ipython", "{{ messages }}"])
@pytest.mark.parametrize("choice", ["auto", "required", "none", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("parallel", [False, True])
def test_every_format_grammar_is_one_llama_cpp_takes(model, template: str, choice: Any, parallel: bool) -> None:  # type: ignore[no-untyped-def]
    """Each format's grammar (wrapper + the tools' schemas, lazy for ``auto``) parses in llama.cpp."""
    import llama_cpp

    from engine.grammar import gbnf_of, grammar_sampler
    from orchestrator.generation.parsers.base import CALL_RULE

    plan = plan_of(template, [WEATHER, ADD], choice, parallel)
    assert plan is not None
    got = plan.grammar()
    if got is None:
        assert choice == "none" and plan.format != "generic"
        return
    gbnf, schema, triggers = got
    assert bool(triggers) == (choice == "auto" and plan.format != "generic")
    sampler = grammar_sampler(model.vocab, gbnf_of(gbnf, json.dumps(schema), CALL_RULE), triggers)
    llama_cpp.llama_sampler_free(sampler)


def test_lazy_grammar_constrains_from_the_trigger_on(model) -> None:  # type: ignore[no-untyped-def]
    """``tool_choice: auto`` on a Hermes template: any text until ``<tool_call>``, then only the call."""
    import ctypes

    import llama_cpp

    from engine.grammar import gbnf_of, grammar_sampler
    from orchestrator.generation.parsers.base import CALL_RULE

    plan = plan_of(QWEN25, [ADD], "auto", False)
    assert plan is not None
    gbnf, schema, triggers = plan.grammar() or ("", {}, [])
    sampler = grammar_sampler(model.vocab, gbnf_of(gbnf, json.dumps(schema), CALL_RULE), triggers)

    def allowed(text: str) -> bool:
        tok = model.tokenize(text, False, False)[0]
        one = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(tok, 0.0, 0.0))
        arr = llama_cpp.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
        return one[0].logit != float("-inf")

    try:
        assert allowed("Paris") and allowed("<")  # not triggered: everything goes
        for tok in model.tokenize("Sure. <tool_call>", False, False):
            llama_cpp.llama_sampler_accept(sampler, tok)
        assert not allowed("Paris") and allowed("\n")  # triggered: the call's grammar
        for tok in model.tokenize('\n{"name": "', False, False):
            llama_cpp.llama_sampler_accept(sampler, tok)
        assert allowed("add") and not allowed("get")  # only the tools' names
    finally:
        llama_cpp.llama_sampler_free(sampler)
