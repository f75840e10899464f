"""``POST /classify``: a real classifier GGUF against the transformers model it was converted from.

The model is built at test time (tests/classifier_model.py) and converted by
llama.cpp's own converter.  That converter drops BERT's pooler (``pooler.dense``
then tanh) and maps ``classifier`` onto the [CLS] hidden state directly, so the
oracle is transformers' encoder run on the same ids followed by the classifier on
[CLS]: ``model.classifier(model.bert(ids).last_hidden_state[:, 0])``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.classifier_model import LABELS, MAX_POSITIONS, build_hf_classifier, convert_to_gguf, converter_script
from tests.conftest import ServerProc

pytest.importorskip("transformers")
TOL = 5e-3  # max |logit difference| allowed; measured up to 1.8e-3 (f32 GGUF, 5 inputs, 2-core CPU)

TEXTS = [
    "I love this product, it works great!",
    "This is terrible, worst purchase ever.",
    "It is okay, nothing special.",
]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    if converter_script() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not unpacked (scripts/setup test does it)")
    work = tmp_path_factory.mktemp("classifier")
    model, tok = build_hf_classifier(work / "bert-tiny-cls")
    return model, tok, convert_to_gguf(work / "bert-tiny-cls", work / "bert-tiny-cls.gguf")


@pytest.fixture(scope="module")
def cls_server(classifier: tuple[Any, Any, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = tmp_path_factory.mktemp("cls-server")
    srv = ServerProc(
        [
            "--threads",
            "2",
            "--parallel",
            "1",
            "--ctx-size",
            "512",
            "--no-persist",
            "--classifier-model",
            str(classifier[2]),
        ],
        work,
    ).start()
    yield srv
    srv.stop()


def oracle(model: Any, tok: Any, texts: list[str]) -> np.ndarray:
    """transformers' logits of the head llama.cpp's GGUF keeps (see module docstring), ``float32[n, n_labels]``."""
    import torch

    rows = []
    with torch.no_grad():
        for text in texts:
            enc = tok(text, return_tensors="pt")
            hidden = model.bert(**enc).last_hidden_state[:, 0]
            rows.append(model.classifier(hidden)[0].numpy())
    return np.stack(rows)


def scores(preds: list[dict[str, Any]]) -> np.ndarray:
    by_label = {p["label"]: p["score"] for p in preds}
    return np.array([by_label[label] for label in LABELS], dtype=np.float32)


def post(srv: ServerProc, body: Any, path: str = "/v1/classify") -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_single_input_matches_transformers(cls_server: ServerProc, classifier: tuple[Any, Any, Path]) -> None:
    model, tok, _ = classifier
    assert httpx.get(cls_server.url + "/health", timeout=10).json()["classifier"] == "ready"
    r = post(cls_server, {"inputs": TEXTS[0]}, "/classify")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"]
    preds = body["predictions"]
    assert [p["label"] for p in preds] != [] and sorted(p["label"] for p in preds) == sorted(LABELS)
    assert [p["score"] for p in preds] == sorted((p["score"] for p in preds), reverse=True)
    n_tok = len(tok(TEXTS[0])["input_ids"])
    assert body["usage"] == {"prompt_tokens": n_tok, "total_tokens": n_tok}
    want = oracle(model, tok, [TEXTS[0]])[0]
    diff = float(np.abs(scores(preds) - want).max())
    print(f"single input: max |logit diff| vs transformers = {diff:.2e}; logits {want}")
    assert diff < TOL
    assert np.ptp(want) > 0.05  # the random head separates the labels, so the order check means something


def test_batch_matches_transformers(cls_server: ServerProc, classifier: tuple[Any, Any, Path]) -> None:
    model, tok, _ = classifier
    r = post(cls_server, {"inputs": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["predictions"]) == len(TEXTS)
    got = np.stack([scores(p) for p in body["predictions"]])
    want = oracle(model, tok, TEXTS)
    diff = float(np.abs(got - want).max())
    print(f"batch of {len(TEXTS)}: max |logit diff| vs transformers = {diff:.2e}")
    assert diff < TOL
    assert body["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    # one input alone and inside a batch give the same logits
    alone = scores(post(cls_server, {"inputs": TEXTS[1]}).json()["predictions"])
    assert np.abs(alone - got[1]).max() < TOL


def test_empty_string(cls_server: ServerProc, classifier: tuple[Any, Any, Path]) -> None:
    model, tok, _ = classifier
    r = post(cls_server, {"inputs": ""})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 2  # [CLS] [SEP]
    assert np.abs(scores(body["predictions"]) - oracle(model, tok, [""])[0]).max() < TOL


def test_over_long_input_is_refused(cls_server: ServerProc) -> None:
    long_text = " ".join(["good"] * (MAX_POSITIONS + 10))
    r = post(cls_server, {"inputs": ["fine", long_text]})
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == "CONTEXT_OVERFLOW"
    assert f"at most {MAX_POSITIONS}" in r.json()["error"]
    # the server goes on serving
    assert post(cls_server, {"inputs": "fine"}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [{}, {"inputs": []}, {"inputs": 3}, {"inputs": ["a", 1]}, {"inputs": ["x"] * 65}, {"input": "x"}],
)
def test_bad_bodies(cls_server: ServerProc, body: Any) -> None:
    r = post(cls_server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == "INVALID_REQUEST"


def test_server_without_classifier(start_server: Callable[..., ServerProc]) -> None:
    srv = start_server("--parallel", "1", "--ctx-size", "512", "--no-persist")
    for path in ("/classify", "/v1/classify"):
        r = httpx.post(srv.url + path, json={"inputs": "hello"}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error_code"] == "NO_MODEL"
        assert "--classifier-model" in r.json()["error"]


def test_generation_model_is_not_a_classifier(tmp_path: Path, model_path: Path) -> None:
    # The generation engine and the classifier load side by side, and /health answers for the
    # generation engine (``classifier: loading`` meanwhile): on a fast host the server can report
    # healthy before the classifier's load fails.  Either way the server must stop, saying why.
    srv = ServerProc(["--threads", "2", "--no-persist", "--classifier-model", str(model_path)], tmp_path)
    with contextlib.suppress(RuntimeError):
        srv.start(timeout=120)
    proc = srv.proc
    assert proc is not None
    try:
        proc.wait(timeout=120)  # stops by itself (raises TimeoutExpired otherwise)
    finally:
        srv.stop()
    assert proc.returncode is not None
    assert "not a classifier" in srv.log_path.read_text(errors="replace")
