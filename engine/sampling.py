"""Sampler chains (llama.cpp's samplers) and logprobs from a logits row.

The chain follows llama-server's default order (llama.cpp ``common/sampling.cpp``
``common_sampler_init``; ``--samplers`` in ``tools/server/README.md``): logit bias (the
request's ``logit_bias`` and its banned tokens at -inf), penalties
(repeat/frequency/presence), DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC,
temperature (dynamic with ``dynatemp_range``) and the seeded distribution sampler.
Mirostat (1 or 2) replaces everything from top-n-sigma on with temperature + Mirostat, as in
llama-server.  With
``temperature <= 0`` the last stage is ``greedy`` (after Mirostat's stages: none), and the
stages that always keep the most likely token (top-n-sigma, top-k, top-p, min-p) are left
out since they cannot change it.

The grammar sampler is kept beside the chain and applied as llama-server applies it
(``common_sampler_sample``): see :meth:`SamplerChain.sample`.  Nothing here samples by
itself: llama.cpp does.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterable

import llama_cpp as llama
import numpy as np

from contract.options import SamplingParams
from engine.grammar import gbnf_of, grammar_sampler
from engine.reasoning_budget import ReasoningBudget

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
MIROSTAT_M = 100  # llama-server's m for Mirostat 1 (common/sampling.cpp)
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data
assert TOKEN_DATA.itemsize == ctypes.sizeof(llama.llama_token_data)
NO_TOKEN = -1  # what :meth:`SamplerChain.sample` returns when the grammar allows no token


def stage_names(p: SamplingParams) -> list[str]:
    """The llama.cpp samplers a chain for ``p`` holds, in order, by ``llama_sampler_name`` (the
    grammar is kept beside the chain, as llama-server keeps it)."""
    greedy = p.temperature <= 0
    names = ["logit-bias"] if p.banned_tokens or p.logit_bias else []
    if p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
        names.append("penalties")
    if p.dry_multiplier > 0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0:
        names.append("dry")
    if not p.mirostat:
        optional = [
            ("top-n-sigma", p.top_n_sigma > 0 and not greedy),
            ("top-k", p.top_k > 0 and not greedy),
            ("typical", p.typical_p < 1.0),
            ("top-p", 0 < p.top_p < 1 and not greedy),
            ("min-p", p.min_p > 0 and not greedy),
            ("xtc", p.xtc_probability > 0 and p.xtc_threshold <= 0.5),
        ]
        names += [name for name, on in optional if on]
    if greedy:
        names.append("greedy")
    else:
        temp = "temp-ext" if p.dynatemp_range > 0 and not p.mirostat else "temp"  # as common_sampler_init
        names += [temp, {0: "dist", 1: "mirostat", 2: "mirostat-v2"}[p.mirostat]]
    return names


class SamplerChain:
    """A ``llama_sampler`` chain for one generation (:func:`stage_names`); free with :meth:`close`.

    ``vocab``: the model's ``llama_vocab *``; ``n_vocab``: its size.  Raises
    :class:`engine.grammar.GrammarError` for a grammar or JSON schema llama.cpp cannot use.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab: llama.llama_vocab_p,
        n_vocab: int,
        budget: ReasoningBudget | None = None,
    ) -> None:
        self.budget = budget
        gbnf = gbnf_of(params.grammar, params.json_schema, params.schema_rule)
        self.grammar = grammar_sampler(vocab, gbnf, params.grammar_triggers) if gbnf else None  # beside the chain
        self.n_vocab = n_vocab
        # llama-server's post_sampling_probs: sample through the candidate array and keep it (:meth:`post_probs`)
        self.keep_candidates = params.post_sampling_probs and params.n_probs > 0
        self.greedy = params.temperature <= 0
        self._kept = 0  # how many candidates of ``_cur`` the last pick left (its ``size``), ``_selected`` its pick
        self._selected = -1
        self.ptr = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        self._history: list[tuple[llama.llama_sampler_p, int]] = []  # (sampler, window) fed the context
        # the candidates of a constrained (or post_sampling_probs) sample: llama_token_data[n_vocab]
        self._cur: np.ndarray | None = None
        self._ids = np.empty(0, np.int32)
        p = params
        seed = LLAMA_DEFAULT_SEED if p.seed < 0 else p.seed & 0xFFFFFFFF
        breakers = [b.encode() for b in p.dry_sequence_breakers]
        c_breakers = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
        make: dict[str, Callable[[], llama.llama_sampler_p]] = {
            "logit-bias": lambda: self._logit_bias(p, n_vocab),
            "penalties": lambda: llama.llama_sampler_init_penalties(
                n_vocab, p.repeat_last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            ),
            "dry": lambda: llama.llama_sampler_init_dry(
                vocab,
                p.dry_multiplier,
                p.dry_base,
                p.dry_allowed_length,
                p.dry_penalty_last_n,
                c_breakers,
                len(breakers),
            ),
            "top-n-sigma": lambda: llama.llama_sampler_init_top_n_sigma(p.top_n_sigma),
            "top-k": lambda: llama.llama_sampler_init_top_k(p.top_k),
            "typical": lambda: llama.llama_sampler_init_typical(p.typical_p, 1),
            "top-p": lambda: llama.llama_sampler_init_top_p(p.top_p, 1),
            "min-p": lambda: llama.llama_sampler_init_min_p(p.min_p, 1),
            "xtc": lambda: llama.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, 1, seed),
            "temp": lambda: llama.llama_sampler_init_temp(p.temperature),
            "temp-ext": lambda: llama.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent),
            "dist": lambda: llama.llama_sampler_init_dist(seed),
            "mirostat": lambda: llama.llama_sampler_init_mirostat(
                n_vocab, seed, p.mirostat_tau, p.mirostat_eta, MIROSTAT_M
            ),
            "mirostat-v2": lambda: llama.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta),
            "greedy": llama.llama_sampler_init_greedy,
        }
        windows = {"penalties": p.repeat_last_n, "dry": p.dry_penalty_last_n}
        for name in stage_names(p):
            smpl = make[name]()
            llama.llama_sampler_chain_add(self.ptr, smpl)  # the chain owns (and frees) it from here
            if name in windows:
                self._history.append((smpl, windows[name]))

    @staticmethod
    def _logit_bias(p: SamplingParams, n_vocab: int) -> llama.llama_sampler_p:
        pairs = [(tok, float("-inf")) for tok in p.banned_tokens] + list(p.logit_bias)
        biases = (llama.llama_logit_bias * len(pairs))()
        for i, (tok, bias) in enumerate(pairs):
            biases[i] = llama.llama_logit_bias(tok, bias)
        return llama.llama_sampler_init_logit_bias(n_vocab, len(pairs), biases)

    def accept_history(self, tokens: Iterable[int]) -> None:
        """Feed the context's last tokens to the penalty and DRY samplers (llama-server feeds the
        prompt the same way, grammar left out); each keeps its own window of the last n."""
        history = list(tokens)
        for smpl, window in self._history:
            for tok in history[-window:] if window > 0 else history:
                llama.llama_sampler_accept(smpl, tok)

    def sample(self, ctx: llama.llama_context_p, batch_index: int) -> int:
        """The next token: the one a thinking budget forces (:mod:`engine.reasoning_budget`, accepted by
        the chain and, where it allows it, the grammar), else :meth:`_sample`'s pick."""
        if self.budget is None:
            return self._sample(ctx, batch_index)
        tok = self.budget.forced()
        if tok is None:
            tok = self._sample(ctx, batch_index)
        else:
            self._kept = 0  # no candidates: post_probs gives llama-server's default
            if self.grammar is not None and self._allowed(tok):
                llama.llama_sampler_accept(self.grammar, tok)
            llama.llama_sampler_accept(self.ptr, tok)
        if tok != NO_TOKEN:
            self.budget.accept(tok)
        return tok

    def _sample(self, ctx: llama.llama_context_p, batch_index: int) -> int:
        """Sample from the logits of ``batch_index`` of the last decode and accept the token.

        With a grammar, as llama-server (``common_sampler_sample``): the chain picks a token, the
        grammar checks that one token, and only when it refuses is the chain applied again to the
        candidates the grammar allows.  Returns :data:`NO_TOKEN` (and accepts nothing) when no
        token can follow: the grammar is complete and its end of generation is banned, or the
        other stages refused every token it allows (llama.cpp aborts the process when a grammar
        accepts a token it does not allow, so every pick is checked before the accept).

        With ``post_sampling_probs`` the chain is applied to a candidate array of ours, kept for
        :meth:`post_probs` (llama-server's ``common_sampler_get_candidates``); else, without a grammar,
        llama.cpp's ``llama_sampler_sample`` does it all.
        """
        if self.grammar is None and not self.keep_candidates:
            return int(llama.llama_sampler_sample(self.ptr, ctx, batch_index))
        logits = logits_row(ctx, batch_index, self.n_vocab)
        tok = self._pick(logits, grammar_first=False)
        if self.grammar is None:
            if tok != NO_TOKEN:
                llama.llama_sampler_accept(self.ptr, tok)
            return tok
        if tok == NO_TOKEN or not self._allowed(tok):
            tok = self._pick(logits, grammar_first=True)
            if tok == NO_TOKEN:
                return NO_TOKEN
        llama.llama_sampler_accept(self.grammar, tok)
        llama.llama_sampler_accept(self.ptr, tok)
        return tok

    def _pick(self, logits: np.ndarray, grammar_first: bool) -> int:
        """Apply the chain (after the grammar when ``grammar_first``) to every token; the pick, or
        :data:`NO_TOKEN` when it is at -inf (nothing allowed was left)."""
        if self._cur is None:
            self._cur = np.zeros(self.n_vocab, TOKEN_DATA)
            self._ids = np.arange(self.n_vocab, dtype=np.int32)
        cur = self._cur
        cur["id"], cur["logit"], cur["p"] = self._ids, logits, 0.0
        data = cur.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
        arr = llama.llama_token_data_array(data=data, size=self.n_vocab, selected=-1, sorted=False)
        if grammar_first:
            llama.llama_sampler_apply(self.grammar, ctypes.byref(arr))
            if not np.isfinite(cur["logit"]).any():
                return NO_TOKEN
        llama.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        self._kept, self._selected = arr.size, arr.selected  # the samplers shrink the array in place
        if not 0 <= arr.selected < arr.size:
            return NO_TOKEN
        picked = arr.data[arr.selected]
        return int(picked.id) if math.isfinite(picked.logit) else NO_TOKEN

    def post_probs(self, n_probs: int) -> tuple[float, list[tuple[int, float]]]:
        """After :meth:`sample` (with ``post_sampling_probs``): the sampled token's probability after the
        chain, and the ``n_probs`` most likely candidates after it as ``(id, p)``, best first, those at 0
        left out, as llama-server's ``populate_token_probs`` (``tools/server/server-context.cpp``, with
        ``post_sampling``) reads them: the last stage (``dist``, Mirostat) leaves a probability on every
        token the chain kept.

        With ``temperature <= 0`` llama-server's chain ends in temperature 0 (every token but the most
        likely set to -inf) and ``dist``, so the pick has probability 1 and no other token any; this chain
        ends in llama.cpp's ``greedy`` instead, which picks the same token and leaves no probabilities, so
        that answer is given as it is: ``(1.0, [(pick, 1.0)])``.
        """
        sel = self._selected
        if self._cur is None or not 0 <= sel < self._kept:
            return 1.0, []  # llama-server's default (the token not among the candidates)
        cur = self._cur[: self._kept]
        if self.greedy:
            return 1.0, [(int(cur["id"][sel]), 1.0)] if n_probs > 0 else []
        p = cur["p"]
        n = min(n_probs, len(p))
        best = np.argpartition(-p, n - 1)[:n] if 0 < n < len(p) else np.arange(n)
        best = best[np.argsort(-p[best], kind="stable")]
        top = [(int(cur["id"][i]), float(p[i])) for i in best if p[i] > 0]
        return float(p[sel]), top

    def _allowed(self, tok: int) -> bool:
        """Whether the grammar allows ``tok`` next (it leaves its logit finite)."""
        one = (llama.llama_token_data * 1)(llama.llama_token_data(tok, 0.0, 0.0))
        arr = llama.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        llama.llama_sampler_apply(self.grammar, ctypes.byref(arr))
        return math.isfinite(one[0].logit)

    def close(self) -> None:
        """Free the chain (and every sampler in it)."""
        if self.ptr:
            llama.llama_sampler_free(self.ptr)
            self.ptr = None
        if self.grammar:
            llama.llama_sampler_free(self.grammar)
            self.grammar = None


def logits_row(ctx: llama.llama_context_p, batch_index: int, n_vocab: int) -> np.ndarray:
    """``float32[n_vocab]`` view of the logits of ``batch_index`` (valid until the next decode)."""
    ptr = llama.llama_get_logits_ith(ctx, batch_index)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))


def logprobs(logits: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-softmax probability of ``token`` and the ``n_top`` best ``(id, logprob)``.

    Computed from the raw logits row (before sampling transforms), like vLLM's logprobs, in float32 as llama.cpp's
    own softmax (``llama_sampler_softmax_impl``, ``src/llama-sampler.cpp``) and llama-server's probabilities are:
    numpy's float32 ``exp`` and pairwise ``sum`` (relative error ~1e-7 x log2(n_vocab)) take ~80 µs for a
    49,152-token vocabulary where a float64 pass took ~165 µs, on the decode thread of every token (the native
    API returns every token's logprob).
    """
    m = logits.max()
    shifted = logits - m
    np.exp(shifted, out=shifted)
    lse = float(m) + float(np.log(shifted.sum()))
    top: list[tuple[int, float]] = []
    if n_top > 0:
        idx = np.argpartition(logits, -n_top)[-n_top:]
        idx = idx[np.argsort(-logits[idx])]
        top = [(int(i), float(logits[i]) - lse) for i in idx]
    return float(logits[token]) - lse, top
