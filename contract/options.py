"""The request options a generation carries: how it samples and what attention it captures.

:class:`SamplingParams` is llama.cpp's sampler chain as llama-server names it (tools/server/README.md,
"POST /completion"; common/common.h ``common_params_sampling``), with the API's defaults (docs/api.md,
"Generation parameters"); :class:`CaptureOptions` is what a generation captures per token (docs/api.md,
"Attention formats").  Both travel in the worker protocol's ``Generate`` (and the sampler settings in
``CheckSampling``, :mod:`contract.protocol`): the orchestrator fills them in, the engine worker reads them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from contract.framing import NonNegInt

DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")  # llama-server's default ``dry_sequence_breakers``


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampler chain settings (llama.cpp samplers, llama-server names).  The defaults are the
    API's (docs/api.md, "Generation parameters"; llama-server's ``/completion`` defaults), declared here only.

    ``temperature <= 0`` means greedy; ``seed == -1`` means random.  Token ids are
    already validated against the vocabulary by the orchestrator.
    """

    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1
    banned_tokens: list[int] = []
    stop_tokens: list[int] = []
    stop_strings: list[str] = []
    ignore_eos: bool = False
    n_probs: int = 0  # how many top_logprobs per token (0: none)
    logprobs: bool = False  # compute the sampled token's logprob
    # llama-server's ``post_sampling_probs``: with ``n_probs`` > 0, ``Token.prob`` and ``Token.top_probs`` are the
    # probabilities after the sampler chain (engine/sampling.py ``SamplerChain.post_probs``) instead of ``top``
    post_sampling_probs: bool = False
    # llama-server's further samplers (tools/server/README.md, "POST /completion"; common/common.h
    # ``common_params_sampling``); each default turns its sampler off.  engine/sampling.py builds the chain.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # -1 is resolved to n_ctx by the orchestrator
    dry_sequence_breakers: list[str] = msgspec.field(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS))
    top_n_sigma: float = -1.0  # < 0: off
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0  # > 0: the temperature moves within +- this with the entropy (temp-ext)
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 0: off, 1: Mirostat, 2: Mirostat 2.0 (replaces top-k ... temperature + dist)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: list[tuple[int, float]] = []  # (token, bias added to its logit); -inf bans it
    grammar: str = ""  # GBNF (llama.cpp grammars/README.md), root rule ``root``
    json_schema: str = ""  # a JSON schema as JSON text; turned into GBNF by the worker (``grammar`` wins)
    schema_rule: str = ""  # set: ``json_schema``'s GBNF is added to ``grammar`` as this rule (engine/grammar.py)
    grammar_triggers: list[str] = []  # set: a lazy grammar, from the first match of one of these regexes on
    # a thinking budget (engine/reasoning_budget.py; llama-server's reasoning_budget_tokens): -1 none, else the
    # tokens a thought between the tags may take before the message and the end tag are forced
    reasoning_budget: int = -1
    reasoning_start: str = ""  # the thinking tags, as text (e.g. "<think>", "</think>")
    reasoning_end: str = ""
    reasoning_message: str = ""  # forced before the end tag when the budget is spent (--reasoning-budget-message)
    reasoning_open: bool = False  # the prompt opened the thought: the budget counts from the first token


AttentionFormat = Literal["per_layer", "aggregated", "topk", "spans"]
AttentionDtype = Literal["float32", "float16"]
GRAPH_FORMATS: tuple[AttentionFormat, ...] = ("per_layer", "aggregated")
"""The formats llama.cpp's graph computes (libllama/llama-attn.h); the others are reduced from them in the worker."""


class CaptureOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What to capture per generated token (docs/api.md, "Attention formats").

    ``attention``: rows of ``kq_soft_max-{il}`` gathered into input-position order, then in ``format``:
    ``per_layer`` ``[n_layers_sel, n_heads_sel, n_ctx]``; ``aggregated`` the mean over the selected layers
    and heads ``[n_ctx]``; ``topk`` per selected layer and head the ``top_k`` largest weights, best first,
    ``[n_layers_sel, n_heads_sel, min(top_k, n_ctx)]`` (their input positions travel beside them as
    ``int32`` of the same shape); ``spans`` the mean over the selected layers and heads summed over each
    ``[start, end)`` of ``spans`` (input positions, sorted, disjoint), ``[len(spans)]``.  Weights in
    ``dtype``.  ``layers``: subset of layer indices (default all); ``heads``: subset of head indices
    (default all).  ``sink`` > 0: also the mean over the selected layers and heads of the weight on
    positions ``0..sink-1`` (a float32 figure per token).  ``hidden_state``: the final hidden state
    ``float32[n_embd]``.
    """

    attention: bool = False
    format: AttentionFormat = "per_layer"
    dtype: AttentionDtype = "float32"
    layers: list[int] | None = None
    hidden_state: bool = False
    heads: list[int] | None = None
    top_k: NonNegInt = 0
    spans: list[tuple[NonNegInt, NonNegInt]] = []
    sink: NonNegInt = 0

    @property
    def reduced(self) -> bool:
        """Whether the worker reduces the graph's rows (a format or figure the graph does not compute)."""
        return self.format not in GRAPH_FORMATS or self.heads is not None or self.sink > 0
