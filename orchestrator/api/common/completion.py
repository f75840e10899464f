"""llama.cpp's completion: the ``POST /completion`` body, its answer and stream chunks, and how they are
built from a generation (llama.cpp ``tools/server/README.md``, "POST /completion"; ``server-task.cpp``).
Shared by llama-server's surface and the OpenAI answers, which embed it as ``__verbose`` as llama-server does."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from contract import protocol as proto
from contract.options import SamplingParams
from orchestrator.api.common.run import (
    piece_text,
)
from orchestrator.api.common.timings import Timings, timings_of
from orchestrator.api.common.wire import PromptProgress
from orchestrator.generation.events import DoneOut, TokenOut
from orchestrator.generation.parsers.reasoning import ReasoningPlan
from orchestrator.generation.pieces import Piece, ReasoningDelta
from orchestrator.generation.request import (
    INT32_MAX,
    CanonicalRequest,
    Float32,
    NonNegFloat32,
    NProbs,
    Probability,
    RepeatLastN,
    SamplerFields,
    Seed,
    TopK,
)
from orchestrator.generation.service import sampling_params
from orchestrator.slots.model import slot_id_out


class TokenProb(msgspec.Struct, kw_only=True):
    """One of a token's ``top_logprobs`` (the model's log-probability), or with ``post_sampling_probs`` one of
    its ``top_probs`` (the probability after the sampler chain, 0 < ``prob`` <= 1)."""

    id: int
    token: str
    bytes_: list[int] = msgspec.field(name="bytes")
    logprob: float | UnsetType = UNSET
    prob: float | UnsetType = UNSET


class CompletionProb(msgspec.Struct, kw_only=True):
    """llama-server's ``completion_probabilities[]`` entry (``n_probs``; ``tools/server/server-task.cpp``
    ``completion_token_output::probs_vector_to_json``): ``logprob`` and ``top_logprobs`` (the model's
    distribution), or with ``post_sampling_probs`` ``prob`` and ``top_probs`` (after the sampler chain, at
    most ``n_probs``, none at 0: fewer when fewer tokens are left)."""

    id: int
    token: str
    bytes_: list[int] = msgspec.field(name="bytes")
    logprob: float | UnsetType | None = UNSET
    top_logprobs: list[TokenProb] | UnsetType = UNSET
    prob: float | UnsetType = UNSET
    top_probs: list[TokenProb] | UnsetType = UNSET


class LogitBiasEntry(msgspec.Struct, kw_only=True):
    """One logit bias as llama-server reports it (``task_params::format_logit_bias``); null (its JSON for
    ``-inf``): a banned token."""

    bias: float | None
    token: int


class SamplerSettings(msgspec.Struct, kw_only=True):
    """llama-server's ``params`` / ``generation_settings`` (``n_ctx`` in ``generation_settings`` only)."""

    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_last_n: int
    repeat_penalty: float
    max_tokens: int
    n_predict: int
    ignore_eos: bool
    n_probs: int
    post_sampling_probs: bool
    stop: list[str]
    presence_penalty: float
    frequency_penalty: float
    typical_p: float
    top_n_sigma: float
    xtc_probability: float
    xtc_threshold: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: list[str]
    dynatemp_range: float
    dynatemp_exponent: float
    mirostat: int
    mirostat_tau: float
    mirostat_eta: float
    grammar: str
    logit_bias: list[LogitBiasEntry]
    samplers: list[str]
    n_ctx: int | UnsetType = UNSET


class LlamaCompletion(msgspec.Struct, kw_only=True):
    """llama-server's ``POST /completion`` without ``stream`` (``stop: true``)."""

    index: int
    content: str
    tokens: list[int]
    id_slot: int | str
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: SamplerSettings
    prompt: str
    has_new_line: bool
    truncated: bool
    stop_type: str
    stopping_word: str | None
    tokens_cached: int
    timings: Timings
    completion_probabilities: list[CompletionProb] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # with reasoning_format (slotserve's): the thought, out of content


class LlamaCompletionChunk(msgspec.Struct, kw_only=True):
    """A streamed ``/completion`` chunk (``stream: true``; ``data: {json}`` events): generated text so far
    not yet sent, with ``stop: false``; the last event is a :class:`LlamaCompletion` (``stop: true``)."""

    index: int
    content: str
    tokens: list[int]
    stop: bool = False
    id_slot: int | str
    tokens_predicted: int
    tokens_evaluated: int
    completion_probabilities: list[CompletionProb] | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET  # timings_per_token: the timings so far
    prompt_progress: PromptProgress | UnsetType = UNSET  # return_progress: a prefill step (no text)
    reasoning_content: str | UnsetType = UNSET  # with reasoning_format: the thought's new text


JSON_PROMPT_STRING_KEY = "prompt_string"


class PromptObject(msgspec.Struct, kw_only=True):
    """``{"prompt_string": ..., "multimodal_data": [base64, ...]}`` (multimodal data is refused)."""

    prompt_string: str | list[int | str]
    multimodal_data: list[str] | None = None


SubPrompt = str | list[int | str] | PromptObject


Prompt = str | list[int | str | list[int | str] | PromptObject] | PromptObject
"""The ``prompt`` field's type (see the module docstring)."""


NPredict = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX, description="-1: to the end of the window")]


class CompletionBody(SamplerFields, kw_only=True):
    """``POST /completion`` (llama-server README, "POST /completion": options; the further samplers,
    ``grammar`` and ``json_schema`` in :class:`orchestrator.generation.request.SamplerFields`)."""

    prompt: Prompt
    n_predict: NPredict | None = None  # None: the server's --n-predict
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int | str = -1
    n_probs: NProbs = 0
    temperature: Float32 | None = None
    top_k: TopK | None = None
    top_p: Probability | None = None
    min_p: Probability | None = None
    repeat_penalty: NonNegFloat32 | None = None
    repeat_last_n: RepeatLastN | None = None
    seed: Seed | None = None
    stop: list[str] | None = None
    ignore_eos: bool = False
    return_tokens: bool = False
    post_sampling_probs: bool = False
    response_fields: list[str] | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    # llama-server's thinking budget (its README): tokens (-1 or None: --reasoning-budget), the tags (None: the
    # chat template's) and the message forced before the end tag; reasoning_format (slotserve's: None or
    # "none" leaves thoughts in content, as llama-server's /completion) splits them into reasoning_content
    reasoning_budget_tokens: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    reasoning_budget_start_tag: str | None = None
    reasoning_budget_end_tag: str | None = None
    reasoning_budget_message: str | None = None
    reasoning_format: str | None = None


STOP_TYPE = {"length": "limit", "stop_token": "eos", "stop_string": "word", "cancelled": "none"}


DEFAULT_PARAMS = SamplingParams(max_new_tokens=-1)


# llama-server's default sampler order, its ``samplers`` names (engine/sampling.py builds the chain so)
SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


def params_json(p: SamplingParams | None, n_ctx: int | None = None) -> dict[str, Any]:
    """llama-server's ``params`` / ``generation_settings`` object for sampler settings ``p``."""
    p = p or DEFAULT_PARAMS
    out: dict[str, Any] = {
        "seed": p.seed,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "max_tokens": p.max_new_tokens,
        "n_predict": p.max_new_tokens,
        "ignore_eos": p.ignore_eos,
        "n_probs": p.n_probs,
        "post_sampling_probs": p.post_sampling_probs,
        "stop": list(p.stop_strings),
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "typical_p": p.typical_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers),
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "grammar": p.grammar,
        # a banned token is llama-server's -inf bias, which its JSON writes as null
        "logit_bias": [{"bias": b, "token": t} for t, b in p.logit_bias]
        + [{"bias": None, "token": t} for t in p.banned_tokens],
        "samplers": SAMPLERS,
    }
    if n_ctx is not None:
        out["n_ctx"] = n_ctx
    return out


def _alternative(tok: int, pieces: list[bytes], **value: float) -> TokenProb:
    """One of a token's alternatives: ``logprob=`` or ``prob=``."""
    return TokenProb(id=tok, token=piece_text(pieces[tok]), bytes_=list(pieces[tok]), **value)


def _probs(t: TokenOut, pieces: list[bytes], post_sampling: bool) -> CompletionProb:
    """``t``'s ``completion_probabilities`` entry: its logprobs, or with ``post_sampling`` (llama-server's
    ``post_sampling_probs``) its probabilities after the sampler chain (``prob``, ``top_probs``)."""
    out = CompletionProb(id=t.token_id, token=piece_text(t.piece), bytes_=list(t.piece))
    if post_sampling:
        out.prob = t.prob if t.prob is not None else 1.0  # llama-server's value when it has none
        out.top_probs = [_alternative(k, pieces, prob=p) for k, p in t.top_probs]
    else:
        out.logprob = t.logprob
        out.top_logprobs = [_alternative(k, pieces, logprob=lp) for k, lp in t.top]
    return out


class Completion:
    """One ``/completion`` request: its canonical form and the response shapes."""

    def __init__(
        self,
        body: CompletionBody,
        req: CanonicalRequest,
        info: proto.ModelInfo,
        pieces: list[bytes],
        model: str,
        index: int = 0,
        reasoning: ReasoningPlan | None = None,
    ):
        self.body, self.req, self.info, self.pieces, self.index = body, req, info, pieces, index
        self.reasoning = reasoning  # thoughts split out when reasoning.split
        self.model, self.n_ctx = model, info.n_ctx
        self.slot_out: int | str = -1 if req.slot is None else slot_id_out(req.slot)  # set once a slot is chosen

    def probs(self, tokens: list[TokenOut]) -> list[CompletionProb]:
        """``tokens``' ``completion_probabilities`` entries (``post_sampling_probs``: ``prob``, ``top_probs``)."""
        return [_probs(t, self.pieces, self.body.post_sampling_probs) for t in tokens]

    def partial(self, text: str, tokens: list[TokenOut], n_done: int) -> LlamaCompletionChunk:
        """A streamed chunk (``stop: false``)."""
        return LlamaCompletionChunk(
            index=self.index,
            content=text,
            tokens=[t.token_id for t in tokens] if self.body.return_tokens else [],
            id_slot=self.slot_out,
            tokens_predicted=n_done,
            tokens_evaluated=len(self.req.input_ids or ()),
            completion_probabilities=self.probs(tokens) if self.body.n_probs else UNSET,
        )

    def final(self, text: str, tokens: list[TokenOut], done: DoneOut, prompt: str) -> LlamaCompletion:
        """The last (or only) response (``stop: true``, ``timings``)."""
        d = done
        probs = self.body.n_probs and not self.body.stream
        thoughts = self.reasoning.parser() if self.reasoning else None
        thought: str | UnsetType = UNSET
        if thoughts is not None and not self.body.stream:
            text, thought = split_text(thoughts.whole(text))
        return LlamaCompletion(
            index=self.index,
            content=text,
            reasoning_content=thought,
            tokens=[t.token_id for t in tokens] if self.body.return_tokens else [],
            id_slot=slot_id_out(done.slot_id),
            stop=True,
            model=self.model,
            tokens_predicted=d.n_generated,
            tokens_evaluated=d.n_prompt,
            generation_settings=msgspec.convert(
                params_json(sampling_params(self.req, self.info), self.n_ctx), SamplerSettings
            ),
            prompt=prompt,
            has_new_line="\n" in text,
            truncated=d.truncated,
            stop_type=STOP_TYPE.get(d.finish_reason, "none"),
            stopping_word=d.stop_string,
            tokens_cached=d.seq_tokens,
            timings=timings_of(d),
            completion_probabilities=self.probs(tokens) if probs else UNSET,
        )


def split_text(pieces: list[Piece]) -> tuple[str, str]:
    """``(content, reasoning)`` of a reasoning parser's pieces."""
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))


def nested_values(paths: list[str], result: dict[str, Any]) -> dict[str, Any]:
    """``response_fields``: the values at ``paths`` (``"a/b"`` reads ``result["a"]["b"]``), keyed by
    the path; paths that lead nowhere are left out (llama-server ``json_get_nested_values``)."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = result
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out
