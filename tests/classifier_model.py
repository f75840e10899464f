"""A small, randomly initialised BERT sequence classifier, built and converted to GGUF at test time.

Nothing is downloaded: the WordPiece vocabulary is written here, the weights come
from ``torch.manual_seed``, and the GGUF is written by llama.cpp's own converter
(``convert_hf_to_gguf.py`` with its ``conversion/`` package and ``gguf-py``) taken from
the vendored llama.cpp of the llama-cpp-python sdist; ``scripts/setup test`` unpacks
them into ``<venv>/share/llama.cpp`` (or set ``SLOTSERVE_LLAMA_CONVERTER`` to the
script).

The converter names a tokenizer's pre-tokenizer by hashing the ids a known model
gives for a fixed text; a locally built vocabulary matches no known model, so the
run patches that lookup to ``"default"``.  llama.cpp reads the pre-tokenizer name
only for BPE vocabularies; BERT's WordPiece (``tokenizer.ggml.model = "bert"``)
ignores it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LABELS = ["NEGATIVE", "NEUTRAL", "POSITIVE"]
MAX_POSITIONS = 128  # n_ctx_train of the GGUF: longer inputs are refused
_TEXT = "i love this product it works great the is terrible worst purchase ever okay nothing special good bad very not"
WORDS = [*_TEXT.split(), "a", "an", "and", "or", "but", "movie", "film", "was", "so", "hello", "world", "of", "to"]

_PATCHED_RUN = """
import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
import conversion.gemma as gemma, conversion.phi as phi
# a locally trained byte-level BPE vocabulary, as Gemma 3's and Phi-4's without a tokenizer.model
gemma.Gemma2Model.set_vocab = phi.Phi3MiniModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [str(script), *sys.argv[2:]]
runpy.run_path(str(script), run_name="__main__")
"""


def converter_script() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` if it is unpacked (see module docstring), else None."""
    env = os.environ.get("SLOTSERVE_LLAMA_CONVERTER")
    path = Path(env) if env else Path(sys.prefix) / "share" / "llama.cpp" / "convert_hf_to_gguf.py"
    return path if path.is_file() and (path.parent / "conversion").is_dir() else None


def build_hf_classifier(out: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """Write a ``BertForSequenceClassification`` (3 labels) and its tokenizer to ``out``; return (model, tokenizer)."""
    import torch
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    chars = sorted({c for w in WORDS for c in w} | set("0123456789.,!?'"))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *sorted(set(WORDS)), *(f"##{c}" for c in chars)]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    if int(transformers.__version__.split(".")[0]) >= 5:  # v5 takes the vocabulary itself
        tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    else:
        tok = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True)
    assert tok.convert_ids_to_tokens(tok("love")["input_ids"]) == ["[CLS]", "love", "[SEP]"]
    tok.save_pretrained(out)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.2,  # larger than BERT's 0.02 so the random logits spread out
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model, tok


def convert_to_gguf(hf_dir: Path, gguf_path: Path) -> Path:
    """Run llama.cpp's converter (float32 weights) on ``hf_dir``; raise with its output on failure."""
    script = converter_script()
    if script is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py is not unpacked: run scripts/setup test")
    cmd = [sys.executable, "-c", _PATCHED_RUN, str(script), str(hf_dir), "--outfile", str(gguf_path)]
    res = subprocess.run([*cmd, "--outtype", "f32"], capture_output=True, text=True)
    if res.returncode != 0 or not gguf_path.is_file():
        raise RuntimeError(
            f"convert_hf_to_gguf.py failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        )
    return gguf_path
