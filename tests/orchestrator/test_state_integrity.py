"""Damaged slot states are refused with ``BAD_STATE`` and change nothing (real server, real model).

Bit flips that keep the K/V values finite are only detectable with a digest: the client's
``Repr-Digest`` header / JSON ``digest`` (RFC 9530) on ``restore-state``, or the store's
checksum for a blob damaged in the store.  Non-finite K/V values are refused by the engine
whatever the client sends.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from slotstate.seq_state import parse
from slotstate.ses1 import unpack_ses1
from tests.conftest import CHAT, ServerProc

OCTET = "application/octet-stream"


def _generate(srv: ServerProc, slot: str, prompt: str) -> dict[str, Any]:
    body = {"prompt": CHAT.format(prompt), "max_new_tokens": 4, "temperature": 0, "id_slot": slot}
    r = httpx.post(srv.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _action(srv: ServerProc, slot: str, action: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}/slots/{slot}", params={"action": action}, timeout=60, **kw)


def _save(srv: ServerProc, slot: str) -> tuple[bytes, str]:
    r = _action(srv, slot, "save-state", headers={"Accept": OCTET, "Want-Repr-Digest": "sha-256=10"})
    assert r.status_code == 200, r.text
    return r.content, r.headers["repr-digest"]


def _sha256(blob: bytes) -> str:
    return f"sha-256=:{base64.b64encode(hashlib.sha256(blob).digest()).decode()}:"


def _kv_records(blob: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """(offset of the llama.cpp state in the SES1 blob, its K/V records (type, offset, length))."""
    state = unpack_ses1(blob).state
    return len(blob) - len(state), list(parse(state).data)


def _flip_kv(blob: bytes, n_flips: int) -> bytes:
    """``n_flips`` single-bit flips in mantissa bits of fp16 K/V values (they stay finite)."""
    base, records = _kv_records(blob)
    rng = np.random.default_rng(n_flips)
    damaged = bytearray(blob)
    for _ in range(n_flips):
        _type, off, size = records[int(rng.integers(len(records)))]
        word = base + off + 2 * int(rng.integers(size // 2))
        damaged[word] ^= 1 << int(rng.integers(8))  # the low byte: mantissa bits only
    assert damaged != bytearray(blob)
    return bytes(damaged)


def _nan_k0(blob: bytes) -> bytes:
    """Layer 0's K cache full of fp16 NaN (0x7E00)."""
    base, records = _kv_records(blob)
    ggml_type, off, size = records[0]
    assert ggml_type == 1, "the default KV cache is fp16"
    damaged = bytearray(blob)
    damaged[base + off : base + off + size] = b"\x00\x7e" * (size // 2)
    return bytes(damaged)


def _same_kv(a: bytes, b: bytes) -> bool:
    """Same tokens, positions and K/V bytes (the sequence ids written in the state may differ)."""
    sa, sb = unpack_ses1(a), unpack_ses1(b)
    pa, pb = parse(sa.state), parse(sb.state)
    kv = [
        (bytes(sa.state[o : o + n]), bytes(sb.state[q : q + m]))
        for (_, o, n), (_, q, m) in zip(pa.data, pb.data, strict=True)
    ]
    return sa.tokens == sb.tokens and list(pa.positions) == list(pb.positions) and all(x == y for x, y in kv)


def _restore_octet(srv: ServerProc, slot: str, blob: bytes, digest: str | None) -> httpx.Response:
    headers = {"Content-Type": OCTET} | ({"Repr-Digest": digest} if digest else {})
    return _action(srv, slot, "restore-state", content=blob, headers=headers)


def _restore_json(srv: ServerProc, slot: str, blob: bytes, digest: str | None) -> httpx.Response:
    body: dict[str, Any] = {"state": base64.b64encode(blob).decode()}
    if digest:
        body["digest"] = digest
    return _action(srv, slot, "restore-state", json=body)


RESTORES: dict[str, Callable[[ServerProc, str, bytes, str | None], httpx.Response]] = {
    "octet": _restore_octet,
    "json": _restore_json,
}


@pytest.fixture(scope="module")
def saved(server: ServerProc) -> tuple[bytes, str]:
    _generate(server, "integrity", "Name three colours.")
    return _save(server, "integrity")


def test_save_state_returns_its_digest(server: ServerProc, saved: tuple[bytes, str]) -> None:
    blob, digest = saved
    assert digest == _sha256(blob)
    r = _action(server, "integrity", "save-state")
    assert r.status_code == 200
    body = r.json()
    assert body["digest"] == _sha256(base64.b64decode(body["state"])) == digest


def test_raw_save_hashes_only_when_asked(server: ServerProc, saved: tuple[bytes, str]) -> None:
    """RFC 9530 section 4: the raw save answers ``Repr-Digest`` only for a ``Want-Repr-Digest`` naming an
    algorithm it knows with a preference above 0 (the highest one wins); a malformed one is 400 and changes
    nothing."""
    blob, digest = saved
    plain = _action(server, "integrity", "save-state", headers={"Accept": OCTET})
    assert plain.status_code == 200 and plain.content == blob and "repr-digest" not in plain.headers
    for want, got in [("sha-512=9, sha-256=2", "sha-512"), ("sha-256=1", "sha-256"), ("sha-256=0, md5=10", None),
                      ("unixsum=3", None)]:  # fmt: skip
        r = _action(server, "integrity", "save-state", headers={"Accept": OCTET, "Want-Repr-Digest": want})
        assert r.status_code == 200 and r.content == blob, (want, r.text)
        if got is None:
            assert "repr-digest" not in r.headers, want
        else:
            hasher = hashlib.sha512 if got == "sha-512" else hashlib.sha256
            assert r.headers["repr-digest"] == f"{got}=:{base64.b64encode(hasher(blob).digest()).decode()}:", want
    for bad in ("sha-256", "sha-256=11", "sha-256=:AAAA:", "((("):
        r = _action(server, "integrity", "save-state", headers={"Accept": OCTET, "Want-Repr-Digest": bad})
        assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST", (bad, r.text)
    assert _save(server, "integrity") == (blob, digest)


@pytest.mark.parametrize("path", ["octet", "json"])
@pytest.mark.parametrize("damage", ["flip1", "flip100", "nan_k0"])
def test_damaged_state_is_refused_and_changes_nothing(
    server: ServerProc, saved: tuple[bytes, str], path: str, damage: str
) -> None:
    blob, digest = saved
    damaged = {"flip1": lambda b: _flip_kv(b, 1), "flip100": lambda b: _flip_kv(b, 100), "nan_k0": _nan_k0}[damage](
        blob
    )
    before_tokens = _action(server, "integrity", "tokens").json()["tokens"]
    # Flips keep the values finite: only the digest can tell.  NaN is refused without one.
    r = RESTORES[path](server, "integrity", damaged, digest if damage.startswith("flip") else None)
    assert r.status_code == 400, r.text
    assert r.json()["error_code"] == "BAD_STATE"
    message = r.json()["error"]["message"]  # the slot API answers in llama-server's error shape
    assert ("digest" in message) if damage.startswith("flip") else ("NaN" in message)
    assert _action(server, "integrity", "tokens").json()["tokens"] == before_tokens
    assert _save(server, "integrity")[0] == blob  # KV bytes as before
    # A refused restore into a new slot leaves no slot behind.
    r = RESTORES[path](server, f"integrity-new-{path}-{damage}", damaged, digest if damage != "nan_k0" else None)
    assert r.json()["error_code"] == "BAD_STATE"
    assert _action(server, f"integrity-new-{path}-{damage}", "tokens").json()["error_code"] == "SLOT_NOT_FOUND"


@pytest.mark.parametrize("path", ["octet", "json"])
def test_matching_digest_restores(server: ServerProc, saved: tuple[bytes, str], path: str) -> None:
    blob, digest = saved
    r = RESTORES[path](server, f"integrity-copy-{path}", blob, digest)
    assert r.status_code == 200, r.text
    assert _same_kv(_save(server, f"integrity-copy-{path}")[0], blob)


def test_bad_digest_values(server: ServerProc, saved: tuple[bytes, str]) -> None:
    blob, _ = saved
    for value in ("sha-256=abc", "not a dictionary (", "md5=:AAAA:"):
        r = _restore_octet(server, "integrity-bad-digest", blob, value)
        assert r.status_code == 400 and r.json()["error_code"] == "INVALID_REQUEST", (value, r.text)
    # An extra unknown algorithm is ignored when a known one matches.
    r = _restore_octet(server, "integrity-bad-digest", blob, f"foo=:AAAA:, {_sha256(blob)}")
    assert r.status_code == 200, r.text


def test_damaged_blob_in_the_store(start_server: Callable[..., ServerProc], tmp_path: Path) -> None:
    """A parked slot whose stored state was damaged on disk (one bit of a KV chunk: the state is stored in
    chunks, docs/operations.md "Incremental states") gets BAD_STATE; the damaged chunk is removed (written
    once, it would be found stored by the next save of its key), the slot's metadata stays; the client's
    resend rebuilds the slot by a re-prefill."""
    import asyncio

    from orchestrator.slots.model import slot_key
    from orchestrator.tenants.principal import DEFAULT_TENANT
    from storage.directory import DirectoryStore

    state_dir = tmp_path / "state"
    srv = start_server("--parallel", "1", "--codec", "none", "--ctx-size", "512", "--state-dir", str(state_dir))
    _generate(srv, "victim", "Count to five.")
    _generate(srv, "other", "Say hi.")  # one sequence: "victim" is parked
    listed = {s["id"]: s for s in httpx.get(srv.url + "/slots", timeout=30).json()}
    assert listed["victim"]["place"] == "parked" and listed["victim"]["codec"] == "none"
    store = DirectoryStore(state_dir)
    meta = asyncio.run(store.get_meta(slot_key(DEFAULT_TENANT, "victim")))
    assert meta is not None and meta.chunks, "stored in KV chunks"
    path = store.chunks.path(meta.chunks[-1].key)
    data = bytearray(path.read_bytes())
    data[-1000] ^= 0x01  # one bit of the last layer's V values (finite: only the checksum can tell)
    path.write_bytes(bytes(data))
    body = {"prompt": "x", "max_new_tokens": 2, "id_slot": "victim"}
    r = httpx.post(srv.url + "/api/v1/generate", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error_code"] == "BAD_STATE", r.text
    assert "checksum" in r.json()["error"]
    assert not path.exists(), "the damaged chunk is removed, never restored nor replaced by other bytes"
    after = asyncio.run(store.get_meta(slot_key(DEFAULT_TENANT, "victim")))
    assert after is not None and after.generation == meta.generation, "the slot's metadata is unchanged"
    assert _generate(srv, "other", "Say hi again.")["generated_text"]  # the server is fine
    again = httpx.post(srv.url + "/api/v1/generate", json=body, timeout=120)
    assert again.status_code == 200, again.text  # the resend: prefilled again
