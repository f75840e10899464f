"""Sampler chains (llama.cpp's samplers) and logprobs from a logits row.

The chain follows llama-server's order: logit bias (banned tokens at -inf),
repetition penalty, then greedy when ``temperature <= 0``, else top-k, top-p,
min-p, temperature and the seeded distribution sampler.  Nothing here samples by
itself: llama.cpp does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import llama_cpp as llama
import numpy as np

from engine.protocol import SamplingParams

LLAMA_DEFAULT_SEED = 0xFFFFFFFF


class SamplerChain:
    """A ``llama_sampler`` chain for one generation; free with :meth:`close`."""

    def __init__(self, params: SamplingParams, n_vocab: int, history: Iterable[int] = ()) -> None:
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        self.ptr = chain
        if params.banned_tokens:
            n = len(params.banned_tokens)
            biases = (llama.llama_logit_bias * n)()
            for i, tok in enumerate(params.banned_tokens):
                biases[i].token = tok
                biases[i].bias = float("-inf")
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_logit_bias(n_vocab, n, biases))
        if params.repeat_penalty != 1.0:
            llama.llama_sampler_chain_add(
                chain,
                llama.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0),
            )
        if params.temperature <= 0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_k(params.top_k))
            if 0 < params.top_p < 1:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0:
                llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_min_p(params.min_p, 1))
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(params.temperature))
            seed = LLAMA_DEFAULT_SEED if params.seed < 0 else params.seed & 0xFFFFFFFF
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(seed))
        if params.repeat_penalty != 1.0:
            last = list(history)[-params.repeat_last_n :] if params.repeat_last_n > 0 else list(history)
            for tok in last:
                llama.llama_sampler_accept(chain, tok)

    def sample(self, ctx: llama.llama_context_p, batch_index: int) -> int:
        """Sample from the logits of ``batch_index`` of the last decode (and accept the token)."""
        return int(llama.llama_sampler_sample(self.ptr, ctx, batch_index))

    def close(self) -> None:
        """Free the chain."""
        if self.ptr:
            llama.llama_sampler_free(self.ptr)
            self.ptr = None


def logits_row(ctx: llama.llama_context_p, batch_index: int, n_vocab: int) -> np.ndarray:
    """``float32[n_vocab]`` view of the logits of ``batch_index`` (valid until the next decode)."""
    ptr = llama.llama_get_logits_ith(ctx, batch_index)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))


def logprobs(logits: np.ndarray, token: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-softmax probability of ``token`` and the ``n_top`` best ``(id, logprob)``.

    Computed from the raw logits row (before sampling transforms), like vLLM's logprobs.
    """
    m = float(logits.max())
    lse = m + float(np.log(np.exp(logits - m, dtype=np.float64).sum()))
    top: list[tuple[int, float]] = []
    if n_top > 0:
        idx = np.argpartition(logits, -n_top)[-n_top:]
        idx = idx[np.argsort(-logits[idx])]
        top = [(int(i), float(logits[i]) - lse) for i in idx]
    return float(logits[token]) - lse, top
