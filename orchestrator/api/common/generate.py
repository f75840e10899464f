"""The generate body every surface turns its request into (the native ``/api/v1/generate`` body,
KoboldCpp's and llama-server's field names merged): :class:`GenerateRequest` and its canonical form."""

from __future__ import annotations

from typing import Any

from contract.options import AttentionDtype, AttentionFormat, SamplingParams
from orchestrator.generation.request import (
    DEFAULT,
    CanonicalRequest,
    Float32,
    NonNegFloat32,
    NProbs,
    Probability,
    RepeatLastN,
    SamplerFields,
    Seed,
    TokenCount,
    TopK,
)


class GenerateRequest(SamplerFields, kw_only=True):
    """A generation request: the whole context as ``input_ids`` (or a ``prompt`` text)."""

    type: str | None = None
    request_id: str | None = None
    input_ids: list[int] | None = None
    prompt: str | None = None
    max_new_tokens: TokenCount | None = None
    max_length: TokenCount | None = None
    max_tokens: TokenCount | None = None
    n_predict: TokenCount | None = None
    temperature: Float32 | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: NonNegFloat32 | None = None
    rep_pen: NonNegFloat32 | None = None
    repeat_penalty: NonNegFloat32 | None = None
    rep_pen_range: RepeatLastN | None = None
    repeat_last_n: RepeatLastN | None = None
    seed: Seed | None = None
    sampler_seed: Seed | None = None
    stop_tokens: list[int] | None = None
    banned_tokens: list[int | str] | None = None  # ids, or KoboldCpp's strings (resolved by the handler)
    stop_sequence: list[str] | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    return_attention: bool | None = None
    output_attentions: bool | None = None
    attention_format: AttentionFormat = "per_layer"
    attention_dtype: AttentionDtype = "float32"
    attention_layers: list[int] | None = None
    attention_heads: list[int] | None = None
    attention_top_k: int = 0
    attention_spans: list[tuple[int, int]] | None = None
    attention_sink: int = 0
    output_hidden_states: bool = False
    logprobs: bool | None = None
    n_probs: NProbs | None = None
    top_logprobs: NProbs | None = None
    conversation_id: str | int | None = None
    id_slot: str | int | None = None
    wait: bool = False
    # KoboldCpp's fields (koboldcpp.py ``generate``); see orchestrator/api/kobold/routes.py
    genkey: str | None = None
    trim_stop: bool = False
    max_context_length: int | None = None
    memory: str | None = None
    banned_strings: list[str] | None = None
    n: int | None = None
    typical: Probability | None = None  # KoboldCpp's typical_p
    nsigma: Float32 | None = None  # KoboldCpp's top_n_sigma
    return_progress: bool = False  # llama-server's: stream prompt-processing progress events

    def sampler_fields(self) -> dict[str, Any]:
        """:meth:`SamplerFields.sampler_fields`, KoboldCpp's ``typical`` and ``nsigma`` standing in
        for ``typical_p`` and ``top_n_sigma`` when those are missing."""
        out = super().sampler_fields()
        out["typical_p"] = self.typical if self.typical_p is None else self.typical_p
        out["top_n_sigma"] = self.nsigma if self.top_n_sigma is None else self.top_n_sigma
        return out

    def canonical(self, defaults: SamplingParams = DEFAULT) -> CanonicalRequest:
        """Merge aliases (first given wins, slotserve's own names first) into one canonical request;
        a field no alias gives is taken from ``defaults`` (KoboldCpp's routes pass KoboldCpp's)."""

        def first(*vals: Any, default: Any) -> Any:
            return next((v for v in vals if v is not None), default)

        stops: list[str] = []
        for s in (self.stop_sequence, self.stop):
            if isinstance(s, str):
                stops.append(s)
            elif s:
                stops.extend(s)
        slot = first(self.conversation_id, self.id_slot, default=None)
        return CanonicalRequest(
            request_id=self.request_id,
            input_ids=self.input_ids,
            prompt=self.prompt,
            max_new_tokens=int(
                first(
                    self.max_new_tokens,
                    self.max_length,
                    self.max_tokens,
                    self.n_predict,
                    default=defaults.max_new_tokens,
                )
            ),
            temperature=float(first(self.temperature, default=defaults.temperature)),
            top_p=float(first(self.top_p, default=defaults.top_p)),
            top_k=int(first(self.top_k, default=defaults.top_k)),
            min_p=float(first(self.min_p, default=defaults.min_p)),
            repeat_penalty=float(
                first(self.repetition_penalty, self.rep_pen, self.repeat_penalty, default=defaults.repeat_penalty)
            ),
            repeat_last_n=int(first(self.rep_pen_range, self.repeat_last_n, default=defaults.repeat_last_n)),
            seed=int(first(self.seed, self.sampler_seed, default=defaults.seed)),
            stop_tokens=list(self.stop_tokens or []),
            banned_tokens=[t for t in self.banned_tokens or [] if isinstance(t, int)],
            stop_strings=[s for s in stops if s],
            ignore_eos=self.ignore_eos,
            attention=bool(first(self.return_attention, self.output_attentions, default=False)),
            attention_format=self.attention_format,
            attention_dtype=self.attention_dtype,
            attention_layers=self.attention_layers,
            attention_heads=self.attention_heads,
            attention_top_k=self.attention_top_k,
            attention_spans=self.attention_spans,
            attention_sink=self.attention_sink,
            hidden_state=self.output_hidden_states,
            n_probs=int(first(self.top_logprobs, self.n_probs, default=0)),
            slot=None if slot is None else str(slot),  # None: chosen by prompt (orchestrator/slots/anonymous.py)
            wait=self.wait or slot is None,  # a request naming no slot queues, as KoboldCpp does
            progress=self.return_progress,
            **self.sampler_settings(defaults),
        )
