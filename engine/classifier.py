"""A sequence classifier: a GGUF with a classification head, run by llama.cpp.

The model is one that llama.cpp pools with ``LLAMA_POOLING_TYPE_RANK`` and whose
head has ``n_cls_out > 1`` outputs (``BertForSequenceClassification``, ModernBERT,
DistilBERT converted by llama.cpp's ``convert_hf_to_gguf.py``).  With rank pooling,
``llama_get_embeddings_seq`` returns ``float[n_cls_out]``: the raw logits of the
sequence (``include/llama.h``), which is how llama-server's rerank path reads them.
Label names come from ``llama_model_cls_label`` (GGUF key
``<arch>.classifier.output_labels``); a missing name becomes ``LABEL_<i>``.

Inputs are tokenized with the model's special tokens (``[CLS] text [SEP]`` for BERT),
as ``transformers``' tokenizer does.  A non-causal model needs each sequence in one
ubatch, so the context's batch and ubatch are the training context (``n_ctx_train``,
512 for BERT) and a longer input is refused with ``CONTEXT_OVERFLOW``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp as llama
import numpy as np

from contract.errors import ErrorCode
from contract.settings import EngineSettings
from engine import native
from engine.backend import FlashAttnChoice
from engine.errors import EngineError
from engine.model import Model, ModelLoadError, file_fingerprint


class Classifier:
    """A classifier context over ``model`` (or, with ``embed``, an embedder: each input's pooled
    embedding, ``float[n_embd]``, as ``llama_get_embeddings_seq`` returns it for mean, CLS or last
    pooling; ``pooling`` is the ``llama_pooling_type`` in use).

    ``n_seq`` inputs are decoded together in one batch when their tokens fit
    ``n_ctx``.  Raises :class:`ModelLoadError` when the model is not a classifier
    (pooling type other than rank, or ``n_cls_out < 2``).
    """

    def __init__(self, model: Model, n_threads: int, n_seq: int = 8, embed: bool = False) -> None:
        self.model = model
        self.n_ctx = int(model.n_ctx_train)
        self.ctx = None
        if embed:
            # an embedder: the model's own pooling (mean, cls, last), else mean (llama-server's
            # /v1/embeddings needs a pooled output; ``--pooling mean`` is what its README shows)
            ctx, cp = self._context(llama.LLAMA_POOLING_TYPE_UNSPECIFIED, n_seq, n_threads)
            if llama.llama_pooling_type(ctx) in (llama.LLAMA_POOLING_TYPE_NONE, llama.LLAMA_POOLING_TYPE_RANK):
                llama.llama_free(ctx)
                ctx, cp = self._context(llama.LLAMA_POOLING_TYPE_MEAN, n_seq, n_threads)
            self.ctx = ctx
            n_out = int(model.n_embd)
        else:
            n_out = int(llama.llama_model_n_cls_out(model.ptr))
            self.ctx, cp = self._context(llama.LLAMA_POOLING_TYPE_RANK, n_seq, n_threads)
            if llama.llama_pooling_type(self.ctx) != llama.LLAMA_POOLING_TYPE_RANK or n_out < 2:
                self.close()
                raise ModelLoadError(
                    f"{model.path} is not a classifier: it needs pooling type rank and n_cls_out > 1 (has {n_out})"
                )
        ctx = self.ctx
        self.pooling = int(llama.llama_pooling_type(ctx))
        self.n_out = n_out
        self.n_seq = n_seq
        # what engine.model_info reads: a context of n_ctx tokens and no slots
        self.config = EngineSettings(n_ctx=self.n_ctx, n_slots=0, n_spare=0, n_threads=n_threads, capture=False)
        self.n_cells = self.n_ctx
        self.labels = [] if embed else [self._label(i) for i in range(n_out)]
        self.fingerprint = file_fingerprint(model.path, cp.type_k, cp.type_v)
        self.type_k, self.type_v = int(cp.type_k), int(cp.type_v)
        self.self_check_ms = 0.0  # no attention capture to check
        self.attention_layers: tuple[int, ...] = ()  # no attention rows are captured
        self.capture = None
        native.require_patch()
        self.flash_attn = bool(native.lib.llama_attn_flash_attn(ctx))  # what llama.cpp chose for "auto"
        self.flash_choice = FlashAttnChoice("auto", "llama.cpp's choice (classifier context)")
        self.batch = llama.llama_batch_init(self.n_ctx, 0, 1)

    def _context(self, pooling: int, n_seq: int, n_threads: int) -> tuple[llama.llama_context_p, Any]:
        """A context pooling with ``pooling`` whose batch holds one whole sequence of ``n_ctx`` tokens."""
        cp = llama.llama_context_default_params()
        cp.embeddings = True
        cp.pooling_type = pooling
        cp.n_ctx = self.n_ctx
        cp.n_batch = self.n_ctx
        cp.n_ubatch = self.n_ctx
        cp.n_seq_max = n_seq
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.no_perf = True
        if pooling != llama.LLAMA_POOLING_TYPE_RANK:
            # one KV stream for the sequences of a batch, as llama-cpp-python's embedding contexts
            # (llama.py: kv_unified); split streams pooled the first sequence wrongly in a batch
            cp.kv_unified = True
        ctx = llama.llama_init_from_model(self.model.ptr, cp)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a pooled context for {self.model.path}")
        return ctx, cp

    def _label(self, i: int) -> str:
        name = llama.llama_model_cls_label(self.model.ptr, i)
        return name.decode("utf-8", "replace") if name else f"LABEL_{i}"

    def tokenize(self, text: str) -> list[int]:
        """The token ids the head sees for ``text`` (with the model's special tokens)."""
        return self.model.tokenize(text, True, False)

    def classify(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """Raw logits ``float32[len(inputs), n_cls_out]`` for tokenized inputs.

        Raises ``EngineError(CONTEXT_OVERFLOW)`` for an input longer than ``n_ctx``
        tokens, ``EngineError(INVALID_REQUEST)`` for one with no tokens, and
        ``EngineError(INTERNAL)`` when llama.cpp's decode fails.
        """
        for i, ids in enumerate(inputs):
            if not ids:
                raise EngineError(ErrorCode.INVALID_REQUEST, f"input {i} has no tokens")
            if len(ids) > self.n_ctx:
                what = f"input {i} has {len(ids)} tokens; the classifier takes at most {self.n_ctx}"
                raise EngineError(ErrorCode.CONTEXT_OVERFLOW, what)
        out = np.empty((len(inputs), self.n_out), dtype=np.float32)
        start = 0
        while start < len(inputs):
            stop, used = start, 0
            while stop < len(inputs) and stop - start < self.n_seq and used + len(inputs[stop]) <= self.n_ctx:
                used += len(inputs[stop])
                stop += 1
            out[start:stop] = self._decode(inputs[start:stop])
            start = stop
        return out

    def _decode(self, group: Sequence[Sequence[int]]) -> np.ndarray:
        b = self.batch
        i = 0
        for seq, ids in enumerate(group):
            for pos, tok in enumerate(ids):
                b.token[i] = tok
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = 1
                i += 1
        b.n_tokens = i
        mem = llama.llama_get_memory(self.ctx)
        if mem:
            llama.llama_memory_clear(mem, True)
        if llama.llama_decode(self.ctx, b) != 0:
            raise EngineError(ErrorCode.INTERNAL, "llama_decode failed on the classifier")
        rows = np.empty((len(group), self.n_out), dtype=np.float32)
        for seq in range(len(group)):
            ptr = llama.llama_get_embeddings_seq(self.ctx, seq)
            if not ptr:
                raise EngineError(ErrorCode.INTERNAL, f"no classifier output for sequence {seq}")
            rows[seq] = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_out,))
        return rows

    def close(self) -> None:
        """Free the batch and the context."""
        if getattr(self, "batch", None) is not None:
            llama.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            llama.llama_free(self.ctx)
            self.ctx = None
