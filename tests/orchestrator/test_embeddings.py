"""``POST /v1/embeddings`` against llama-cpp-python's own ``Llama(embedding=True).embed`` of the same
model with the same pooling (mean: the default model, SmolLM2, has no pooling of its own) and flash
attention (llama.cpp's "auto" turns it on for a CPU context; off, the vectors differ by ~1e-2), through
the real ``openai`` SDK (which asks for base64) and as plain JSON floats (issue 21, item 2)."""

from __future__ import annotations

from pathlib import Path

import httpx
import llama_cpp
import numpy as np
import psutil
import pytest

from engine.backend import choose_repack, cpu_extra_bufts
from engine.model import default_model_path, init_backend
from tests.conftest import ServerProc
from tests.waiting import wait_until

openai = pytest.importorskip("openai")
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply today."]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    # weights repacked as the server's workers choose (engine.backend.choose_repack: never onto AMX, whose kernels
    # crash, docs/hardware.md); Llama takes llama.cpp's default params, which would repack onto AMX where offered
    init_backend()
    repack = choose_repack(None, cpu_extra_bufts())
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def model_params() -> llama_cpp.llama_model_params:
        params = defaults()
        params.use_extra_bufts = repack.use_extra_bufts
        return params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", model_params)
        llm = llama_cpp.Llama(
            str(default_model_path()), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            n_ctx=0, n_batch=8192, n_ubatch=8192, n_threads=2, verbose=False,
            flash_attn=True,  # as llama.cpp's "auto" picks for the server's pooled context on a CPU
        )  # fmt: skip
    try:
        return np.array(llm.embed(TEXTS, normalize=True), dtype=np.float32)
    finally:
        llm.close()


def test_embeddings_match_llama_cpp_python(server: ServerProc, reference: np.ndarray) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    got = client.embeddings.create(model="m", input=TEXTS)  # the SDK asks for base64 and decodes it
    ours = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert [d.index for d in got.data] == [0, 1] and ours.shape == reference.shape
    assert np.allclose(ours, reference, atol=1e-4), np.abs(ours - reference).max()
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    plain = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=300).json()
    assert plain["object"] == "list" and plain["data"][0]["object"] == "embedding"
    assert np.allclose(plain["data"][0]["embedding"], reference[0], atol=1e-4)
    assert abs(np.linalg.norm(plain["data"][0]["embedding"]) - 1) < 1e-4
    # different texts are far apart, the same text is the same vector
    assert float(ours[0] @ ours[1]) < 0.99 and float(ours[0] @ reference[0]) > 0.9999


def test_embeddings_bad_input(server: ServerProc) -> None:
    for body in ({"input": []}, {"input": [""]}, {"input": 5}, {}):
        r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST", (body, r.text)


def test_embeddings_worker_stops_when_idle_and_starts_again(tmp_path: Path, reference: np.ndarray) -> None:
    """``--embeddings-keep-alive``: the pooled worker is started by the first request, stopped once idle that
    long (its process gone, its memory given back), and started again by the next request, whose vectors are
    the same; a request arriving while it runs keeps it."""
    srv = ServerProc(["--parallel", "1", "--ctx-size", "512", "--threads", "2", "--embeddings-keep-alive", "3",
                      "--state-dir", str(tmp_path / "st")], tmp_path).start()  # fmt: skip
    try:
        server = psutil.Process(srv.proc.pid)

        def workers() -> int:
            """Engine workers under the server; one that exited but is not reaped yet (a zombie) still counts."""
            n = 0
            for p in server.children(recursive=True):
                try:
                    n += "engine.worker" in " ".join(p.cmdline())
                except psutil.ZombieProcess:
                    n += 1
                except psutil.NoSuchProcess:
                    pass
            return n

        assert workers() == 1  # the generation worker only
        body = {"input": TEXTS[0]}
        first = httpx.post(srv.url + "/v1/embeddings", json=body, timeout=300).json()["data"][0]["embedding"]
        assert workers() == 2
        wait_until(lambda: workers() == 1, "the idle embeddings worker stops", timeout=60)
        again = httpx.post(srv.url + "/v1/embeddings", json=body, timeout=300).json()["data"][0]["embedding"]
        assert workers() == 2 and np.allclose(again, reference[0], atol=1e-4) and np.allclose(again, first)
    finally:
        srv.stop()
