"""Small, randomly initialised causal language models of several architectures, built with transformers
and converted to f32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` at test time.

Nothing is downloaded: the byte-level BPE vocabulary is trained here on a few sentences (the
``tokenizers`` package), the weights come from ``torch.manual_seed``, and the converter is the one
``scripts/setup test`` unpacks from the llama.cpp slotserve's libllama is built from
(:func:`tests.classifier_model.converter_script`; its pre-tokenizer lookup is patched to
``"default"``, since a locally trained vocabulary matches no known model).  With f32 weights and an
f32 KV cache llama.cpp's attention is exact to float rounding, so a comparison with transformers'
eager attention is sharp (the default Q4_1 model's floor is ~0.99 per-head correlation).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.classifier_model import _PATCHED_RUN, converter_script

MIN_HEAD_CORR = 0.9999
"""Smallest per-head correlation of a row with transformers' at f32 (measured: 0.99999+)."""

NEAR_TIE = 0.05
"""Logit gap (transformers' best minus the generated token's) accepted as a near-tie: random weights give flat
logits, and over thousands of positions float rounding can flip a near-tie (measured: 0.026 for Gemma 2's
shapes at 4,136 tokens with flash attention on, llama.cpp's CPU kernel summing in another order)."""

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a model pays attention to the words that matter",
    "long conversations are kept in slots and parked when idle",
    "hello world, this is a tiny test of attention rows",
    "numbers 0 1 2 3 4 5 6 7 8 9 and some punctuation . , ! ?",
]


def _tokenizer(out: Path):  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer (vocabulary ~400) saved to ``out``; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


_COMMON = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 8192, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}  # fmt: skip

_TIED = {**_COMMON, "tie_word_embeddings": True}  # Gemma's converter writes no output matrix of its own


@dataclass(frozen=True)
class Family:
    """A tiny model of one architecture: small in hidden size, layers and vocabulary (fast on 2 CPU cores),
    real in what the engine sees: sliding window (tokens), layer pattern, head size, soft-capping, sinks.

    ``build(vocab)`` returns a randomly initialised ``*ForCausalLM``; ``window`` is its local layers'
    sliding window in tokens (0: none), ``windows`` the window of each layer llama.cpp reports
    (``attention_windows`` of docs/api.md: 0 for a global layer), ``shapes`` which real configuration's
    shape parameters it takes (their ``config.json`` on the Hugging Face Hub); ``config`` rewrites the saved
    ``config.json`` where this transformers spells a field otherwise than the real checkpoints do (and
    llama.cpp's converter reads).
    """

    build: Callable[[int], object]
    shapes: str
    window: int = 0
    windows: tuple[int, ...] = ()
    config: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def _llama(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, num_hidden_layers=3, head_dim=64, **_COMMON))


def _qwen2(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # its tokenizer class adds <|endoftext|> past the trained vocabulary
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab + 8, num_hidden_layers=3, **_COMMON))


def _qwen3(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # QK norm (RMSNorm of each head's q and k) and head_dim 128 independent of the hidden size
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, num_hidden_layers=3, head_dim=128, **_COMMON))


def _phi3(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=vocab, num_hidden_layers=3, pad_token_id=1, **_COMMON)
    return Phi3ForCausalLM(cfg)


def _gpt2(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_embd=64, n_layer=3, n_head=4, n_positions=2048, n_ctx=2048, bos_token_id=0, eos_token_id=1
    )
    return GPT2LMHeadModel(cfg)


def _gemma2(vocab: int):  # type: ignore[no-untyped-def]
    # Gemma 2 2B/9B: window 4,096 on every other layer (even ones local), head_dim 256 with
    # query_pre_attn_scalar 256, attention logit soft-capping 50 and final logit soft-capping 30
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=vocab, num_hidden_layers=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=1,
        **{**_TIED, "num_attention_heads": 2, "num_key_value_heads": 1},
    )  # fmt: skip
    return Gemma2ForCausalLM(cfg)


def _gemma3(window: int, rope_scaling: dict[str, object] | None) -> Callable[[int], object]:
    # Gemma 3: five local layers to one global (sliding_window_pattern 6), local RoPE base 10,000 and
    # global 1,000,000, QK norm, head_dim 256 with query_pre_attn_scalar 256; 270M/1B: window 512,
    # 4 heads, 1 KV head; 4B/12B/27B: window 1,024 and linear RoPE scaling 8 on the global layers
    def build(vocab: int):  # type: ignore[no-untyped-def]
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(
            vocab_size=vocab, num_hidden_layers=7, head_dim=256, query_pre_attn_scalar=256, sliding_window=window,
            rope_scaling=rope_scaling, pad_token_id=1, **{**_TIED, "num_key_value_heads": 1},
        )  # fmt: skip
        return Gemma3ForCausalLM(cfg)

    return build


_GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "original_max_position_embeddings": 4096, "truncate": True}  # fmt: skip
"""gpt-oss's YaRN RoPE as llama.cpp computes it: its correction range rounded to whole dimensions
(``ggml_rope_yarn_corr_dims``).  gpt-oss's own config says ``"truncate": false``, which transformers follows
and llama.cpp does not: the global layers' rows then differ by ~1e-5 (per-head correlation 0.9991 at 552
tokens, 0.985 at 2,000; with ``true``, 0.99999999+), a difference of llama.cpp's, not of the capture."""


def _gpt_oss(vocab: int):  # type: ignore[no-untyped-def]
    # gpt-oss 20b/120b: window 128 on every other layer (even ones local), a learned attention sink per
    # head, head_dim 64, YaRN RoPE (factor 32 over 4,096), top-4 routed experts with clamped SwiGLU
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=128, num_local_experts=8, num_experts_per_tok=4,
        bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=131072, rope_parameters=_GPT_OSS_YARN,
    )  # fmt: skip
    model = GptOssForCausalLM(cfg)
    import torch

    with torch.no_grad():  # sinks of a trained model's size (randomly initialised ones are ~0)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def _lfm2(vocab: int):  # type: ignore[no-untyped-def]
    # LFM2-350M's layer pattern: short-convolution layers (a recurrent state each, L_cache 3) with
    # attention at layers 2, 5, 8, 10, 12 and 14 of 16, head_dim 64
    from transformers import Lfm2Config, Lfm2ForCausalLM

    attn = {2, 5, 8, 10, 12, 14}
    cfg = Lfm2Config(
        vocab_size=vocab, num_hidden_layers=16, layer_types=["full_attention" if i in attn else "conv" for i in range(16)],
        block_auto_adjust_ff_dim=False, conv_L_cache=3, pad_token_id=1,
        **{**_COMMON, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
    )  # fmt: skip
    return Lfm2ForCausalLM(cfg)


def _granite_hybrid(vocab: int):  # type: ignore[no-untyped-def]
    # Granite 4.0 H (ibm-granite/granite-4.0-h-tiny): Mamba2 layers (d_state 128, head size 64, one group,
    # conv 4) with one attention layer to nine, no positional embedding in attention ("nope"), a shared MLP
    # beside routed experts; the vocabulary padded to 8 as the converter pads it
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=-(-vocab // 8) * 8, hidden_size=64, intermediate_size=64, num_hidden_layers=10,
        num_attention_heads=4, num_key_value_heads=1, layer_types=["attention" if i == 5 else "mamba" for i in range(10)],
        position_embedding_type="nope", mamba_n_heads=2, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=8192,
    )  # fmt: skip
    return GraniteMoeHybridForCausalLM(cfg)


def _granite_layer_types(config: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0 H's checkpoints name their layers ``mamba`` / ``attention`` (what llama.cpp's converter
    reads, ``conversion/granite.py``); transformers 5 saves ``linear_attention`` / ``full_attention``."""
    names = {"full_attention": "attention", "linear_attention": "mamba"}
    return {**config, "layer_types": [names.get(t, t) for t in config["layer_types"]]}


def _mamba(vocab: int):  # type: ignore[no-untyped-def]
    # recurrent: no attention at all
    from transformers import MambaConfig, MambaForCausalLM

    # the converter pads the vocabulary to a multiple of 8 (pad_vocab_size_multiple) and not the weights
    cfg = MambaConfig(vocab_size=-(-vocab // 8) * 8, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)  # fmt: skip
    return MambaForCausalLM(cfg)


def _alternating(n_layer: int, window: int) -> tuple[int, ...]:
    """Even layers local (``window``), odd ones global: Gemma 2's and gpt-oss's pattern."""
    return tuple(window if i % 2 == 0 else 0 for i in range(n_layer))


def _gemma3_windows(window: int) -> tuple[int, ...]:
    """Seven layers of Gemma 3's pattern: five local, the sixth global, the seventh local again."""
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(7))


FAMILIES: dict[str, Family] = {
    "llama": Family(_llama, "Llama 3.2 1B: head_dim 64, grouped-query attention"),
    "qwen2": Family(_qwen2, "Qwen2.5: grouped-query attention with q/k/v biases"),
    "qwen3": Family(_qwen3, "Qwen3: QK norm, head_dim 128"),
    "phi3": Family(_phi3, "Phi-3: fused qkv and gate/up projections"),
    "gpt2": Family(_gpt2, "GPT-2: learned positions, biases"),
    "gemma2": Family(_gemma2, "Gemma 2 2B/9B: window 4,096 every other layer, head_dim 256, soft-capping 50/30",
                     4096, _alternating(4, 4096)),
    "gemma3": Family(_gemma3(512, None), "Gemma 3 270M/1B: window 512, 5 local : 1 global, head_dim 256",
                     512, _gemma3_windows(512)),
    "gemma3-4b": Family(_gemma3(1024, {"rope_type": "linear", "factor": 8.0}),
                        "Gemma 3 4B-27B: window 1,024, 5 local : 1 global, head_dim 256, linear RoPE 8 (global)",
                        1024, _gemma3_windows(1024)),
    "gpt-oss": Family(_gpt_oss, "gpt-oss: window 128 every other layer, attention sinks, head_dim 64, YaRN, MoE",
                      128, _alternating(4, 128)),
    "lfm2": Family(_lfm2, "LFM2-350M: 10 short-convolution layers, attention at 2, 5, 8, 10, 12, 14"),
    "granite-hybrid": Family(_granite_hybrid, "Granite 4.0 H: Mamba2 layers, one attention layer to nine, NoPE",
                             config=_granite_layer_types),
    "mamba": Family(_mamba, "Mamba: recurrent, no attention"),
}  # fmt: skip
"""Family name -> its tiny model (:class:`Family`)."""


def build_tiny_gguf(arch: str, out: Path, seed: int = 0) -> Path:
    """Build the tiny model of family ``arch`` (a key of :data:`FAMILIES`) in ``out``, convert it to ``out/model-f32.gguf`` and return that path.

    Raises ``RuntimeError`` when llama.cpp's converter is not unpacked (run ``scripts/setup test``) or fails.
    """
    import torch

    script = converter_script()
    if script is None:
        raise RuntimeError("llama.cpp's convert_hf_to_gguf.py is not unpacked: run scripts/setup test")
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(hf)
    torch.manual_seed(seed)
    family = FAMILIES[arch]
    model = family.build(len(tok)).eval()  # type: ignore[attr-defined]
    model.save_pretrained(hf, safe_serialization=True)
    if family.config is not None:
        saved = hf / "config.json"
        saved.write_text(json.dumps(family.config(json.loads(saved.read_text())), indent=2))
    gguf = out / "model-f32.gguf"
    cmd = [sys.executable, "-c", _PATCHED_RUN, str(script), str(hf), "--outtype", "f32", "--outfile", str(gguf)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not gguf.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return gguf


def load_hf(out: Path):  # type: ignore[no-untyped-def]
    """The transformers model :func:`build_tiny_gguf` saved in ``out``, with eager attention, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out / "hf", attn_implementation="eager").float().eval()


class Reference:
    """transformers' eager float32 forward of the tiny model: the attention rows of its attention layers from
    query ``first`` on, ``[L_attn, H, n - first, n]`` (None for a model without attention), and the logits of
    the positions from ``first`` on, ``float32[n - first, n_vocab]``.  Results are kept per token list: a long
    context's forward is the slow part of a family test."""

    def __init__(self, out: Path) -> None:
        self.hf = load_hf(out)
        self._seen: dict[tuple[tuple[int, ...], int], tuple[np.ndarray | None, np.ndarray]] = {}

    def __call__(self, ids: list[int], first: int = 0) -> tuple[np.ndarray | None, np.ndarray]:
        import torch

        key = (tuple(ids), first)
        if key not in self._seen:
            with torch.no_grad():
                try:
                    res = self.hf(torch.tensor([ids]), output_attentions=True)
                except (TypeError, ValueError):  # a recurrent model has no attention to output
                    res = self.hf(torch.tensor([ids]))
            maps = [a[0, :, first:] for a in (getattr(res, "attentions", None) or ()) if a is not None]
            att = torch.stack(maps).numpy().copy() if maps else None
            self._seen[key] = (att, res.logits[0, first:].float().numpy().copy())
        return self._seen[key]


def assert_matches(
    ref: Reference,
    what: str,
    ids: list[int],
    tokens: list[int],
    attention: list[np.ndarray],
    layers: Sequence[int],
    later: tuple[float, float] | None = None,
) -> float:
    """``tokens`` generated greedily after ``ids``, with ``attention`` (each token's ``[L, H, n]`` rows over the
    model's attention ``layers``), match transformers: the tokens are its argmax (or within :data:`NEAR_TIE` of
    it: the reference runs on the generated tokens, so a near-tie taken the other way changes nothing else),
    each head's row correlates at >= :data:`MIN_HEAD_CORR` and is within 5e-3.  ``later``: ``(min correlation,
    max abs difference)`` for the layers after the first attention layer instead, where the engine's own main
    path is known to drift from transformers' float32 (the first layer's inputs are the embeddings, equal on
    both sides, so its rows are still held to :data:`MIN_HEAD_CORR`).  Returns the smallest per-head correlation."""
    n = len(ids)
    att, logits = ref([*ids, *tokens], first=n - 1)
    for k, tok in enumerate(tokens):
        best = int(logits[k].argmax())
        gap = float(logits[k, best] - logits[k, tok])
        assert tok == best or gap <= NEAR_TIE, (what, f"token {k}: {tok}, transformers' argmax {best}", gap)
    if not layers:
        assert attention == [] and att is None, what
        return 1.0
    assert att is not None and att.shape[0] == len(layers), (what, None if att is None else att.shape, layers)
    worst = 1.0
    for k, rows in enumerate(attention):
        q = n - 1 + k
        want = att[:, :, k, : q + 1]
        assert rows.shape == want.shape, (what, k, rows.shape, want.shape)
        for layer in range(rows.shape[0]):
            floor, atol = MIN_HEAD_CORR, 5e-3  # float rounding: up to ~1e-3
            if later is not None and layer > 0:
                floor, atol = later
            corr = min(float(np.corrcoef(rows[layer, head], want[layer, head])[0, 1]) for head in range(rows.shape[1]))
            assert corr >= floor, (what, f"token {k} layer {layers[layer]}", corr, floor)
            np.testing.assert_allclose(rows[layer], want[layer], atol=atol, err_msg=f"{what} token {k} layer {layer}")
            worst = min(worst, corr)
    return worst
