"""DirectoryStore specifics: file naming, crash leftovers, damaged files, unusable roots."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from storage.base import SlotMeta
from storage.directory import DirectoryStore, safe_name
from storage.errors import BadStateError, StoreUnavailableError

pytestmark = pytest.mark.asyncio


def meta_for(slot_id: str, blob: bytes) -> SlotMeta:
    return SlotMeta(slot_id, "fp", 0, [], "none", 0, len(blob), len(blob), 0.0, 0.0)


async def test_safe_names() -> None:
    assert safe_name(b"chat-1_x") == "s_chat-1_x"
    assert safe_name(b"../x") == "s_%2E%2E%2Fx"
    assert safe_name(b"A") != safe_name(b"a")
    assert safe_name("é".encode()) == "s_%C3%A9"
    long = safe_name(b"y" * 300)
    assert long.startswith("h_") and len(long) == 66


async def test_layout_and_prefix_namespace(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, prefix="slotserve:", fsync=False)
    await store.put(meta_for("0", b"abc"), b"abc")
    assert (tmp_path / "s_slotserve%3A" / "s_0" / "slot.bin").is_file()
    bare = DirectoryStore(tmp_path / "bare", prefix="")
    await bare.put(meta_for("0", b"abc"), b"abc")
    assert (tmp_path / "bare" / "s_0" / "slot.bin").is_file()


async def test_crash_leftovers_are_ignored_and_purged(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    stored = await store.put(meta_for("s", b"committed"), b"committed")
    leftover = store.slot_dir("s") / ".tmp-deadbeef"
    leftover.write_bytes(b"SSD1 half-written")  # a put that crashed before its rename
    assert await store.get("s") == (stored, b"committed")
    assert [m.slot_id for m in await store.list_meta()] == ["s"]
    assert await store.purge_expired() == 0
    assert leftover.exists()  # too young to be called stale: a writer may still be busy
    old = time.time() - 7200
    os.utime(leftover, (old, old))
    assert await store.purge_expired() == 0
    assert not leftover.exists()
    assert await store.get("s") == (stored, b"committed")


async def test_damaged_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DirectoryStore(tmp_path)
    await store.put(meta_for("bad", b"x" * 100), b"x" * 100)
    await store.put(meta_for("good", b"y"), b"y")
    path = store.slot_dir("bad") / "slot.bin"
    data = bytearray(path.read_bytes())
    data[30:40] = b"\xff" * 10  # inside the msgpack metadata
    path.write_bytes(bytes(data))
    with pytest.raises(BadStateError):
        await store.get("bad")
    with pytest.raises(BadStateError):
        await store.get_meta("bad")
    assert [m.slot_id for m in await store.list_meta()] == ["good"]
    assert "unreadable slot file" in caplog.text
    path.write_bytes(b"garbage")
    with pytest.raises(BadStateError, match=r"truncated|not a slot file"):
        await store.get("bad")
    replaced = await store.put(meta_for("bad", b"fresh"), b"fresh")  # a damaged slot can be overwritten
    assert replaced.generation == 1
    assert await store.get("bad") == (replaced, b"fresh")


async def test_unusable_root_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = DirectoryStore(blocker / "sub")
    with pytest.raises(StoreUnavailableError):
        await store.ping()
    with pytest.raises(StoreUnavailableError):
        await store.put(meta_for("s", b"x"), b"x")
    with pytest.raises(StoreUnavailableError):
        await store.get("s")
    assert await DirectoryStore(tmp_path / "missing").get("s") is None  # a missing tree is just empty
