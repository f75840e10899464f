"""Attention of tiny f32 models of several architectures vs transformers' eager attention.

Each model is built with transformers and converted by llama.cpp's own converter (``tests/tiny_models.py``),
then generates greedily in our engine with flash attention on (rows from the capture's side branch) and off
(rows from the main path's softmax), f32 KV cache.  Every generated token's rows, per layer and head, must
correlate with transformers' eager attention over the same tokens at >= 0.9999 (measured: 0.999999+), and
the greedy tokens must be transformers' argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.engine import Engine
from engine.model import Model
from engine.settings import EngineSettings
from tests.engine.enginekit import Runner
from tests.tiny_models import ARCHITECTURES, build_tiny_gguf, load_hf

pytestmark = pytest.mark.slow

MIN_HEAD_CORR = 0.9999
N_NEW = 6


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request, tmp_path_factory) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, build_tiny_gguf(request.param, out)


def reference(out: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(attention [L, H, n, n], argmax of each position's logits)`` of transformers, eager, float32."""
    import torch

    hf = load_hf(out)
    with torch.no_grad():
        res = hf(torch.tensor([ids]), output_attentions=True)
    att = torch.stack([a[0] for a in res.attentions]).numpy()
    return att, res.logits[0].argmax(-1).numpy()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_attention_matches_transformers_eager(tiny: tuple[str, Path], flash_attn: str) -> None:
    arch, gguf = tiny
    model = Model(gguf)
    eng = Engine(
        model,
        EngineSettings(n_ctx=256, n_slots=1, n_spare=0, n_threads=2, type_k="f32", type_v="f32",
                       flash_attn=flash_attn, verify_cells=True),  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        assert eng.flash_attn is (flash_attn == "on")
        prompt = model.tokenize("the quick brown fox pays attention to the lazy dog", True, False)
        res = Runner(eng).generate(0, prompt, max_new_tokens=N_NEW, ignore_eos=True)
    finally:
        eng.close()
        model.close()
    ids = prompt + res.tokens
    att, argmax = reference(gguf.parent, ids)
    n = len(prompt)
    np.testing.assert_array_equal(res.tokens, argmax[n - 1 : n - 1 + N_NEW], err_msg=f"{arch}: greedy tokens")
    worst = 1.0
    for k, rows in enumerate(res.attention):
        q = n - 1 + k
        want = att[:, :, q, : q + 1]
        assert rows.shape == want.shape, (arch, k)
        for layer in range(rows.shape[0]):
            for head in range(rows.shape[1]):
                worst = min(worst, float(np.corrcoef(rows[layer, head], want[layer, head])[0, 1]))
        np.testing.assert_allclose(rows, want, atol=1e-4, err_msg=f"{arch} token {k}")
    print(f"\n[{arch}, flash attention {flash_attn}] min per-head correlation {worst:.7f}")
    assert worst >= MIN_HEAD_CORR, (arch, flash_attn, worst)
