"""The canonical generation request every API surface turns its body into, and the sampler fields they share.

Sampler value ranges are checked when a body is decoded and published in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from contract.errors import ErrorCode
from contract.options import DRY_SEQUENCE_BREAKERS, AttentionDtype, AttentionFormat, SamplingParams
from orchestrator.service_error import ServiceError
from orchestrator.tenants.conversation import CacheSalt
from orchestrator.tenants.principal import DEFAULT_PRINCIPAL, Principal

DEFAULT = SamplingParams()  # the sampler defaults, declared once (contract/options.py)


# A preview's defaults: the same sampler, a little more conservative (docs/api.md, "Preview"), no
# repetition penalty; only these four differ from DEFAULT.
PREVIEW = msgspec.structs.replace(DEFAULT, max_new_tokens=50, temperature=0.7, top_p=0.9, min_p=0.0)


# Value ranges, checked when a body is decoded (HTTP and WebSocket alike) and published in
# the OpenAPI schema.  Sampler values reach llama.cpp as C ``float`` / ``int32_t`` /
# ``uint32_t`` (include/llama.h ``llama_sampler_init_*``): larger values would wrap.
FLT_MAX = 3.4028234663852886e38


INT32_MAX = 2**31 - 1


Float32 = Annotated[float, msgspec.Meta(ge=-FLT_MAX, le=FLT_MAX)]


NonNegFloat32 = Annotated[float, msgspec.Meta(ge=0, le=FLT_MAX)]


Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]


TokenCount = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]


NKeep = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX, description="-1: the whole prompt")]


TopK = Annotated[int, msgspec.Meta(ge=-(2**31), le=INT32_MAX, description="<= 0: off")]


RepeatLastN = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX, description="0: off, -1: the context size")]


Seed = Annotated[int, msgspec.Meta(ge=-1, le=2**32 - 1, description="-1: random (llama.cpp's uint32_t seed)")]


NProbs = Annotated[int, msgspec.Meta(ge=0, le=100)]


Mirostat = Annotated[int, msgspec.Meta(ge=0, le=2, description="0: off, 1: Mirostat, 2: Mirostat 2.0")]


Bias = Float32 | bool  # a logit bias; ``false`` bans the token (llama-server)


LogitBias = Annotated[
    dict[str, Bias] | list[tuple[int | str, Bias]],
    msgspec.Meta(description="token id (or text, whose tokens all get it) -> bias added to its logit; false: banned"),
]


DryBreakers = Annotated[list[str], msgspec.Meta(min_length=1, max_length=64)] | str  # a str: a JSON array (SillyTavern)


PreviewTokens = Annotated[int, msgspec.Meta(ge=1, le=256)]


class SamplerFields(msgspec.Struct, kw_only=True):
    """llama-server's further sampler fields (tools/server/README.md, "POST /completion"), shared by
    every generation body; KoboldCpp and OpenAI use the same names (``logit_bias`` as an object)."""

    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    typical_p: Probability | None = None
    top_n_sigma: Float32 | None = None
    xtc_probability: Probability | None = None
    xtc_threshold: Probability | None = None
    dry_multiplier: NonNegFloat32 | None = None
    dry_base: NonNegFloat32 | None = None
    dry_allowed_length: TokenCount | None = None
    dry_penalty_last_n: RepeatLastN | None = None
    dry_sequence_breakers: DryBreakers | None = None
    dynatemp_range: NonNegFloat32 | None = None
    dynatemp_exponent: Float32 | None = None
    mirostat: Mirostat | None = None
    mirostat_tau: NonNegFloat32 | None = None
    mirostat_eta: NonNegFloat32 | None = None
    logit_bias: LogitBias | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # not samplers (CONTEXT_FIELDS): llama-server's prompt cache reuse and context shift (docs/api.md)
    n_cache_reuse: TokenCount | None = None
    n_keep: NKeep | None = None
    n_discard: TokenCount | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: caches are shared only between equal salts (of one tenant)

    def sampler_fields(self) -> dict[str, Any]:
        """These fields as keyword arguments (to pass them on to a :class:`GenerateRequest`)."""
        return {name: getattr(self, name) for name in SamplerFields.__struct_fields__}

    def sampler_settings(self, defaults: SamplingParams = DEFAULT) -> dict[str, Any]:
        """These fields for a :class:`CanonicalRequest`: a missing value is taken from ``defaults``
        (:class:`contract.options.SamplingParams`'s own unless an API has others); ``logit_bias`` as
        pairs, ``json_schema`` as JSON text."""
        fields = self.sampler_fields()
        context = {name: fields.pop(name) for name in CONTEXT_FIELDS}  # not samplers: no default in SamplingParams
        out = {name: getattr(defaults, name) if v is None else v for name, v in fields.items()}
        out.update((name, v) for name, v in context.items() if v is not None)
        breakers = self.dry_sequence_breakers
        out.update(
            dry_sequence_breakers=list(defaults.dry_sequence_breakers) if breakers is None else dry_breakers(breakers),
            logit_bias=logit_bias_pairs(self.logit_bias),
            json_schema=msgspec.json.encode(self.json_schema).decode() if self.json_schema is not None else "",
        )
        return out


CONTEXT_FIELDS = ("n_cache_reuse", "n_keep", "n_discard", "cache_salt")
""":class:`SamplerFields` that are no samplers: how the slot's cache is reused, shifted and
partitioned (:class:`CanonicalRequest`'s defaults apply when a request leaves them out)."""


BiasPairs = list[tuple[int | str, float]]


def logit_bias_pairs(bias: dict[str, float | bool] | list[tuple[int | str, float | bool]] | None) -> BiasPairs:
    """llama-server's ``logit_bias`` (``[[token, bias], ...]`` or ``{"token": bias}``; KoboldCpp's and
    OpenAI's are the object form with id keys) as ``(token id or text, bias)`` pairs; ``false`` is -inf."""
    items = bias.items() if isinstance(bias, dict) else (bias or [])
    out: list[tuple[int | str, float]] = []
    for key, value in items:
        if value is True:  # llama-server skips it silently; it means nothing
            raise ServiceError(ErrorCode.INVALID_REQUEST, "logit_bias: a bias is a number, or false to ban the token")
        tok = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        out.append((tok, float("-inf") if value is False else float(value)))
    return out


def dry_breakers(value: list[str] | str | None) -> list[str]:
    """``dry_sequence_breakers``: a list of strings, or (SillyTavern, KoboldCpp) a JSON-encoded one."""
    if value is None:
        return list(DRY_SEQUENCE_BREAKERS)
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value, type=list[str])
        except msgspec.DecodeError as exc:
            raise ServiceError(
                ErrorCode.INVALID_REQUEST, f"dry_sequence_breakers: not a JSON array of strings: {exc}"
            ) from exc
    if not value or len(value) > 64:
        raise ServiceError(ErrorCode.INVALID_REQUEST, "dry_sequence_breakers: 1 to 64 strings")
    return value


class CanonicalRequest(msgspec.Struct, kw_only=True):
    """A generation request after alias merging (see :meth:`GenerateRequest.canonical`).

    ``logit_bias`` keys may still be texts; the generation service turns them into token ids.
    """

    request_id: str | None
    input_ids: list[int] | None
    prompt: str | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    seed: int
    stop_tokens: list[int]
    banned_tokens: list[int]
    stop_strings: list[str]
    ignore_eos: bool
    attention: bool
    attention_format: AttentionFormat
    attention_dtype: AttentionDtype
    attention_layers: list[int] | None
    hidden_state: bool
    n_probs: int
    slot: str | None  # None: the request names no slot (docs/api.md, "Requests without a slot id")
    wait: bool
    cache_prompt: bool = True  # llama-server's: False, a request naming no slot gets a new, empty one
    progress: bool = False
    post_sampling_probs: bool = False  # llama-server's: the n_probs probabilities after the sampler chain
    # each token's logprob (a log-softmax over the vocabulary on the worker's decode thread, every token): the native
    # API's tokens always carry it; a route whose client did not ask for logprobs sets False
    token_logprobs: bool = True
    presence_penalty: float = DEFAULT.presence_penalty
    frequency_penalty: float = DEFAULT.frequency_penalty
    typical_p: float = DEFAULT.typical_p
    top_n_sigma: float = DEFAULT.top_n_sigma
    xtc_probability: float = DEFAULT.xtc_probability
    xtc_threshold: float = DEFAULT.xtc_threshold
    dry_multiplier: float = DEFAULT.dry_multiplier
    dry_base: float = DEFAULT.dry_base
    dry_allowed_length: int = DEFAULT.dry_allowed_length
    dry_penalty_last_n: int = DEFAULT.dry_penalty_last_n
    dry_sequence_breakers: list[str] = msgspec.field(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS))
    dynatemp_range: float = DEFAULT.dynatemp_range
    dynatemp_exponent: float = DEFAULT.dynatemp_exponent
    mirostat: int = 0
    mirostat_tau: float = DEFAULT.mirostat_tau
    mirostat_eta: float = DEFAULT.mirostat_eta
    logit_bias: BiasPairs = []
    grammar: str = ""
    json_schema: str = ""
    schema_rule: str = ""  # contract.options.SamplingParams: set by the tool-call paths, not by clients
    grammar_triggers: list[str] = []
    reasoning_budget: int = -1  # contract.options.SamplingParams: a thinking budget, set by the chat paths
    reasoning_start: str = ""
    reasoning_end: str = ""
    reasoning_message: str = ""
    reasoning_open: bool = False
    n_cache_reuse: int | None = None  # None: the server's --cache-reuse
    n_keep: int = 0  # llama-server's context shift (--context-shift): tokens kept at the start, -1 the prompt
    n_discard: int = 0  # tokens a shift drops, 0: half of those after n_keep
    principal: Principal = DEFAULT_PRINCIPAL  # who asks: slots and caches are looked up in its tenant only
    cache_salt: str | None = None  # vLLM's cache_salt: caches are shared only between equal salts of a tenant
    conversation_key: str | None = None  # prompt_cache_key, metadata.user_id or a session header (docs/api.md)
    attention_heads: list[int] | None = None  # reduced attention (docs/api.md, "Attention formats")
    attention_top_k: int = 0
    attention_spans: list[tuple[int, int]] | None = None  # None: one span per chat message (format spans)
    attention_sink: int = 0


class AppendToken(msgspec.Struct):
    """One appended token of a preview (docs/api.md)."""

    token_id: int
    text: str = ""


class PreviewRequest(SamplerFields, kw_only=True):
    """``POST /api/v1/generate/preview`` (docs/api.md): the preview's own fields, and the
    generation routes' further sampler fields (:class:`SamplerFields`)."""

    append_tokens: list[AppendToken | int] = msgspec.field(default_factory=list)
    max_tokens: PreviewTokens = PREVIEW.max_new_tokens
    temperature: Float32 = PREVIEW.temperature
    top_p: Probability = PREVIEW.top_p
    top_k: TopK = PREVIEW.top_k
    min_p: Probability = PREVIEW.min_p
    seed: Seed = PREVIEW.seed
    stop_tokens: list[int] = msgspec.field(default_factory=list)
    use_cached_context: bool = True
    input_ids: list[int] | None = None
    conversation_id: str | int | None = None
    id_slot: str | int | None = None
    output_attentions: bool = False
    attention_format: AttentionFormat = "per_layer"
    attention_dtype: AttentionDtype = "float32"

    def canonical(self, slot: str) -> CanonicalRequest:
        """The preview's sampling as a :class:`CanonicalRequest` on ``slot`` (context and appended
        tokens stay in the preview request; the repetition penalty stays off)."""
        return CanonicalRequest(
            request_id=None, input_ids=None, prompt=None, max_new_tokens=self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repeat_penalty=PREVIEW.repeat_penalty, repeat_last_n=PREVIEW.repeat_last_n, seed=self.seed,
            stop_tokens=list(self.stop_tokens), banned_tokens=[], stop_strings=[], ignore_eos=False,
            attention=self.output_attentions, attention_format=self.attention_format,
            attention_dtype=self.attention_dtype, attention_layers=None, hidden_state=False, n_probs=0,
            slot=slot, wait=True, **self.sampler_settings(),
        )  # fmt: skip
