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

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tests.classifier_model import _PATCHED_RUN, converter_script

MIN_HEAD_CORR = 0.9999
"""Smallest per-head correlation of a row with transformers' at f32 (measured: 0.99999+)."""

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
    "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}  # fmt: skip

_TIED = {**_COMMON, "tie_word_embeddings": True}  # Gemma's converter writes no output matrix of its own

SLIDING_WINDOW = 8
"""Window (tokens) of the sliding-window families' local layers: shorter than the tests' prompts."""


def _llama(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, num_hidden_layers=3, **_COMMON))


def _qwen2(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # its tokenizer class adds <|endoftext|> past the trained vocabulary
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab + 8, num_hidden_layers=3, **_COMMON))


def _qwen3(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, num_hidden_layers=3, head_dim=16, **_COMMON))


def _phi3(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=vocab, num_hidden_layers=3, pad_token_id=1, **_COMMON)
    return Phi3ForCausalLM(cfg)


def _gpt2(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_embd=64, n_layer=3, n_head=4, n_positions=512, n_ctx=512, bos_token_id=0, eos_token_id=1
    )
    return GPT2LMHeadModel(cfg)


def _gemma2(vocab: int):  # type: ignore[no-untyped-def]
    # interleaved sliding window (even layers local), attention logit soft-capping
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=vocab, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=1, **_TIED,
    )  # fmt: skip
    return Gemma2ForCausalLM(cfg)


def _gemma3(vocab: int):  # type: ignore[no-untyped-def]
    # five local layers to one global, local and global RoPE bases, QK norm
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=vocab, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
        pad_token_id=1, **_TIED,
    )  # fmt: skip
    return Gemma3ForCausalLM(cfg)


def _lfm2(vocab: int):  # type: ignore[no-untyped-def]
    # hybrid: short-convolution layers (a recurrent state each) between attention layers
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(
        vocab_size=vocab, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
        block_auto_adjust_ff_dim=False, conv_L_cache=3, pad_token_id=1, **_COMMON,
    )  # fmt: skip
    return Lfm2ForCausalLM(cfg)


def _mamba(vocab: int):  # type: ignore[no-untyped-def]
    # recurrent: no attention at all
    from transformers import MambaConfig, MambaForCausalLM

    # the converter pads the vocabulary to a multiple of 8 (pad_vocab_size_multiple) and not the weights
    cfg = MambaConfig(vocab_size=-(-vocab // 8) * 8, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                      bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)  # fmt: skip
    return MambaForCausalLM(cfg)


ARCHITECTURES: dict[str, Callable[[int], object]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3, "gpt2": _gpt2,
    "gemma2": _gemma2, "gemma3": _gemma3, "lfm2": _lfm2, "mamba": _mamba,
}  # fmt: skip
"""Architecture name -> a builder of a randomly initialised ``*ForCausalLM`` of that vocabulary size."""


def build_tiny_gguf(arch: str, out: Path, seed: int = 0) -> Path:
    """Build ``arch``'s tiny model in ``out``, convert it to ``out/model-f32.gguf`` and return that path.

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
    model = ARCHITECTURES[arch](len(tok)).eval()  # type: ignore[attr-defined]
    model.save_pretrained(hf, safe_serialization=True)
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
    """transformers' eager float32 forward of the tiny model: attention ``[L_attn, H, n, n]`` of its attention
    layers and the argmax of each position's logits."""

    def __init__(self, out: Path) -> None:
        self.hf = load_hf(out)

    def __call__(self, ids: list[int]) -> tuple[np.ndarray | None, np.ndarray]:
        import torch

        with torch.no_grad():
            try:
                res = self.hf(torch.tensor([ids]), output_attentions=True)
            except (TypeError, ValueError):  # a recurrent model has no attention to output
                res = self.hf(torch.tensor([ids]))
        maps = [a[0] for a in (getattr(res, "attentions", None) or ()) if a is not None]
        att = torch.stack(maps).numpy() if maps else None
        return att, res.logits[0].argmax(-1).numpy()


def assert_matches(
    ref: Reference, what: str, ids: list[int], tokens: list[int], attention: list[np.ndarray], layers: Sequence[int]
) -> float:
    """``tokens`` generated greedily after ``ids``, with ``attention`` (each token's ``[L, H, n]`` rows over the
    model's attention ``layers``), match transformers: the tokens are its argmax, each head's row correlates at
    >= :data:`MIN_HEAD_CORR` and is within 5e-3.  Returns the smallest per-head correlation."""
    att, argmax = ref([*ids, *tokens])
    n = len(ids)
    np.testing.assert_array_equal(tokens, argmax[n - 1 : n - 1 + len(tokens)], err_msg=f"{what}: tokens")
    if not layers:
        assert attention == [] and att is None, what
        return 1.0
    assert att is not None and att.shape[0] == len(layers), (what, None if att is None else att.shape, layers)
    worst = 1.0
    for k, rows in enumerate(attention):
        q = n - 1 + k
        want = att[:, :, q, : q + 1]
        assert rows.shape == want.shape, (what, k, rows.shape, want.shape)
        for layer in range(rows.shape[0]):
            for head in range(rows.shape[1]):
                worst = min(worst, float(np.corrcoef(rows[layer, head], want[layer, head])[0, 1]))
        np.testing.assert_allclose(rows, want, atol=5e-3, err_msg=f"{what} token {k}")  # float rounding: up to ~1e-3
    assert worst >= MIN_HEAD_CORR, (what, worst)
    return worst
