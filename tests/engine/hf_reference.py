"""An independent reference for the attention rows: Hugging Face transformers, eager attention.

transformers loads the SAME GGUF file (``gguf_file=``; the loader dequantizes every tensor
to float32 with ``gguf``-py and undoes llama.cpp's Q/K row permutation), runs the eager
attention with ``output_attentions=True`` and returns the post-softmax probabilities of
every query.  No llama.cpp code is involved, so agreement checks the whole capture path
(graph callback, layer/head order, cell -> position gather, normalization).

Imports torch / transformers: import this module only after ``pytest.importorskip``.

Why the two sides cannot agree exactly: llama.cpp multiplies a Q4_1 weight by the
activations quantized to Q8_1 (blocks of 32, int8 + an fp16 scale) and keeps K/V in f16;
the reference multiplies by float32 activations.  :func:`llama_cpp_activation_rounding`
emulates the Q8_1 rounding in the reference: the layer-0 rows then agree ~20x closer (the
layer-0 check of the test), while deeper layers stay as far apart as without it because
a rounding flip anywhere is amplified layer after layer.  Measured (SmolLM2-135M Q4_1,
16-token prompts): HF float32 vs the same HF with emulated Q8_1 rounding differ by a worst
per-head mean abs diff of ~0.006 and a min per-head correlation of ~0.991 -- the noise
floor of the comparison, about the same as llama.cpp vs HF.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import: never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
import transformers
from packaging.version import Version


def load_reference(gguf_path: Path) -> torch.nn.Module:
    """The GGUF's model in transformers, float32 weights, eager attention, eval mode."""
    transformers.utils.logging.disable_progress_bar()
    # ``torch_dtype`` was renamed ``dtype`` in 4.56; the default became "auto" in 5.0.
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    with contextlib.redirect_stderr(io.StringIO()):  # the dequantization's tqdm bar ignores the setting above
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            attn_implementation="eager",
            local_files_only=True,
            **{dtype_kw: torch.float32},
        )
    model.eval()
    assert next(model.parameters()).dtype == torch.float32
    return model


def _q8_1(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded like ggml's ``quantize_row_q8_1``: blocks of 32, d = amax/127 (stored fp16)."""
    shape = x.shape
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d.half().float()).reshape(shape)


@contextlib.contextmanager
def llama_cpp_activation_rounding(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every Linear sees its input rounded to Q8_1 as llama.cpp's CPU matmul does."""
    hooks = [
        mod.register_forward_pre_hook(lambda _mod, args: (_q8_1(args[0]), *args[1:]))
        for mod in model.modules()
        if isinstance(mod, torch.nn.Linear)
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def reference_forward(model: torch.nn.Module, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One forward pass over ``ids``: ``(attention[n_layer, n_head, T, T], log_softmax(logits)[T, n_vocab])``."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    att = torch.stack(out.attentions)[:, 0].float().numpy()
    logprobs = torch.log_softmax(out.logits[0].float(), dim=-1).numpy()
    return att, logprobs


def row_stats(ours: np.ndarray, ref: np.ndarray, flat_std: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, head): mean abs diff and Pearson correlation of two ``[L, H, n]`` rows.

    The correlation is NaN where either row is nearly constant (std < ``flat_std``;
    Pearson is undefined there and the mean abs diff alone judges that head).
    """
    ours = ours.astype(np.float64)
    ref = ref.astype(np.float64)
    mad = np.abs(ours - ref).mean(-1)
    oc = ours - ours.mean(-1, keepdims=True)
    rc = ref - ref.mean(-1, keepdims=True)
    flat = (ours.std(-1) < flat_std) | (ref.std(-1) < flat_std)
    denom = np.sqrt((oc**2).sum(-1) * (rc**2).sum(-1))
    corr = np.where(flat, np.nan, (oc * rc).sum(-1) / np.where(flat, 1.0, denom))
    return mad, corr


def generated_rows_vs_reference(rows: list[np.ndarray], att: np.ndarray, n_prompt: int) -> tuple[float, float]:
    """``(min per-head correlation, worst per-head mean abs diff)`` of generated tokens' rows against
    :func:`reference_forward`'s ``att`` (``[L, H, T, T]`` over prompt + generated).

    ``rows[k]`` is generated token k's ``[L, H, n_prompt + k]`` attention: the query at position
    ``n_prompt - 1 + k``.  Nearly constant rows (NaN correlation, see :func:`row_stats`) are skipped.
    """
    mads, corrs = [], []
    for k, row in enumerate(rows):
        q = n_prompt - 1 + k
        mad, corr = row_stats(row, att[:, :, q, : q + 1])
        mads.append(mad)
        corrs.append(corr)
    return float(np.nanmin(corrs)), float(np.max(mads))
