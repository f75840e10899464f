"""Model info, tokenization, CORS, API keys, health and metrics against a real server."""

from __future__ import annotations

import httpx
import pytest
from websockets.sync.client import connect

from tests.conftest import ServerProc


def test_model_info_has_both_seeds_fields(server: ServerProc) -> None:
    a = httpx.get(server.url + "/api/v1/model").json()
    b = httpx.get(server.url + "/api/v1/model/info").json()
    assert a == b
    json_api_fields = ["model_name", "architecture", "vocab_size", "num_layers", "num_attention_heads", "num_key_value_heads",
               "hidden_size", "max_position_embeddings", "rope_theta", "bos_token_id", "eos_token_id", "special_tokens",
               "chat_template", "torch_dtype", "context_length"]  # fmt: skip
    kobold_fields = ["result", "embedding_size", "max_context_length", "max_trained_context", "eot_token_id",
               "rope_freq_base", "rope_freq_scale"]  # fmt: skip
    for k in json_api_fields + kobold_fields:
        assert k in a, k
    assert (a["num_layers"], a["num_attention_heads"], a["num_key_value_heads"], a["vocab_size"]) == (30, 9, 3, 49152)
    assert a["special_tokens"]["im_start_id"] == 1 and a["special_tokens"]["im_end_id"] == 2
    assert a["eot_token_id"] == 2 and a["max_context_length"] == 2048
    assert "<|im_start|>" in a["chat_template"]


def test_tokenize_with_text_plain_like_halo_weave(server: ServerProc) -> None:
    r = httpx.post(
        server.url + "/api/v1/tokenize",
        content=b'{"text": "Hello, how are you?", "add_special_tokens": false}',
        headers={"Content-Type": "text/plain"},
    )
    assert r.status_code == 200
    body = r.json()
    assert body["token_count"] == len(body["token_ids"]) == len(body["tokens"]) == 6
    assert "".join(t["text"] for t in body["tokens"]) == "Hello, how are you?"
    assert [t["token_id"] for t in body["tokens"]] == body["token_ids"]
    d = httpx.post(server.url + "/api/v1/detokenize", json={"token_ids": body["token_ids"]}).json()
    assert d == {"text": "Hello, how are you?"}


def test_tokenize_special_and_partial_utf8(server: ServerProc) -> None:
    body = httpx.post(server.url + "/api/v1/tokenize", json={"text": "<|im_start|>user\n🦉"}).json()
    assert body["token_ids"][0] == 1
    raw = b"".join(bytes(t["bytes"]) if "bytes" in t else t["text"].encode() for t in body["tokens"])
    assert raw == "<|im_start|>user\n🦉".encode()
    assert any("bytes" in t for t in body["tokens"]), "the owl emoji spans byte-level tokens"


def test_llama_server_tokenize_names(server: ServerProc) -> None:
    r = httpx.post(server.url + "/tokenize", json={"content": "Hello world"}).json()
    assert isinstance(r["tokens"][0], int)
    p = httpx.post(server.url + "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()
    assert [t["id"] for t in p["tokens"]] == r["tokens"] and p["tokens"][0]["piece"] == "Hello"
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d == {"content": "Hello world"}


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/api/v1/detokenize", {"token_ids": [1, 49152]}, "INVALID_TOKEN"),
        ("/api/v1/detokenize", {"token_ids": [-1]}, "INVALID_TOKEN"),
        ("/api/v1/detokenize", {"token_ids": "abc"}, "INVALID_REQUEST"),
        ("/api/v1/tokenize", {"text": 5}, "INVALID_REQUEST"),
        ("/api/v1/tokenize", {}, "INVALID_REQUEST"),
        ("/detokenize", {"tokens": [10**12]}, "INVALID_TOKEN"),
    ],
)
def test_tokenize_bad_input(server: ServerProc, path: str, body: object, code: str) -> None:
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400
    assert r.json()["error_code"] == code


def test_malformed_json_is_a_400(server: ServerProc) -> None:
    r = httpx.post(
        server.url + "/api/v1/tokenize", content=b'{"text": "abc', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST"


def test_cors_preflight_and_headers(server: ServerProc) -> None:
    pre = httpx.options(
        server.url + "/api/v1/tokenize",
        headers={
            "Origin": "http://localhost:8080",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert pre.status_code in (200, 204)
    assert pre.headers["access-control-allow-origin"] in ("*", "http://localhost:8080")
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.post(server.url + "/api/v1/tokenize", json={"text": "hi"}, headers={"Origin": "http://localhost:8080"})
    assert r.headers["access-control-allow-origin"] in ("*", "http://localhost:8080")


def test_health_and_metrics(server: ServerProc) -> None:
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = httpx.get(server.url + "/metrics")
    assert m.status_code == 200 and "slotserve_tokens_generated_total" in m.text


def test_openapi_schema_documents_the_api(server: ServerProc) -> None:
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    for path in ["/api/v1/generate", "/api/extra/generate/stream", "/api/v1/tokenize", "/slots/{slot_id}",
                 "/api/v1/generate/preview", "/v1/slots/{slot_id}/info"]:  # fmt: skip
        assert path in schema["paths"], path


def test_api_key(start_server) -> None:  # type: ignore[no-untyped-def]
    srv = start_server("--api-key", "s3cret", "--parallel", "1", "--ctx-size", "512", "--no-persist")
    assert httpx.get(srv.url + "/health").status_code == 200  # public, like llama-server
    assert httpx.get(srv.url + "/metrics").status_code == 401  # llama-server's /metrics needs the key too
    assert "slotserve_" in httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).text
    r = httpx.get(srv.url + "/api/v1/model")
    assert r.status_code == 401 and r.json()["error_code"] == "UNAUTHORIZED"
    r = httpx.get(srv.url + "/api/v1/model", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(srv.url + "/api/v1/model", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(srv.url + "/api/v1/model", headers={"X-Api-Key": "s3cret"}).status_code == 200
    r = httpx.get(srv.url + "/v1/models")  # OpenAI's path: OpenAI's error shape
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error_code"] == "UNAUTHORIZED"
    pre = httpx.options(
        srv.url + "/api/v1/tokenize",
        headers={"Origin": "http://x.test", "Access-Control-Request-Method": "POST"},
    )
    assert pre.status_code in (200, 204)  # preflights never carry the key
    with connect(srv.ws_url + "/api/extra/generate/stream/ws") as ws:
        msg = ws.recv(timeout=10)
        assert '"UNAUTHORIZED"' in msg
    with connect(srv.ws_url + "/api/extra/generate/stream/ws?api_key=s3cret") as ws:
        ws.send('{"prompt": "Hi", "max_length": 2, "temperature": 0}')
        frames = [ws.recv(timeout=60) for _ in range(5)]
        assert any(isinstance(f, str) and '"done"' in f for f in frames)
