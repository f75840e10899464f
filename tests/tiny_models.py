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
from collections.abc import Callable
from pathlib import Path

from tests.classifier_model import _PATCHED_RUN, converter_script

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


def _llama(vocab: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


ARCHITECTURES: dict[str, Callable[[int], object]] = {"llama": _llama}
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
