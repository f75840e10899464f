"""KV chunks of the directory store (:class:`storage.base.ChunkStore`): one file per chunk.

Layout: ``<namespace>/chunks/<first two hex digits>/<key>`` beside the slot directories of
:class:`storage.directory.DirectoryStore` (whose listing skips it).  A chunk is written once: to
``.tmp-<random>`` in its folder, fsynced (unless ``fsync=False``), then renamed to its key; a chunk
already there is only touched (its mtime set to now).  The mtime is what the sweep's grace counts from.
The new chunks of one put are written and fsynced in parallel (up to :data:`WRITERS` threads): one fsync
after another waits for the device once per chunk, where parallel ones share its queue (a 2,000-token
state of SmolLM2-135M is eight chunks of ~5.8 MB).  Blocking I/O; :class:`storage.directory.DirectoryStore`
runs these in a thread.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.base import validate_chunk_key

__all__ = ["ChunkFiles", "fsync_dir"]

_TMP_PREFIX = ".tmp-"
WRITERS = 8  # threads writing one put's new chunks


def fsync_dir(path: Path) -> None:
    """fsync(2) the directory ``path``, so the renames into it survive a power loss. Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ChunkFiles:
    """The chunk files under ``root`` (see module docstring)."""

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync

    def path(self, key: str) -> Path:
        """The file of ``key`` (ValueError for a malformed key)."""
        validate_chunk_key(key)
        return self.root / key[:2] / key

    def put(self, chunks: dict[str, bytes]) -> int:
        """Write the chunks not present (touch the others), in parallel; returns the bytes written.

        Raises OSError from any write (the chunks written before it stay, as any unnamed chunk, until swept)."""
        paths = [(self.path(key), value) for key, value in chunks.items()]
        todo = [(path, value) for path, value in paths if self._touch(path) < 0]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(len(todo), WRITERS), thread_name_prefix="chunk-files") as pool:
                written = sum(pool.map(lambda item: self._write(*item), todo))
        else:
            written = sum(self._write(path, value) for path, value in todo)
        if self.fsync:
            for folder in {path.parent for path, _ in todo}:
                fsync_dir(folder)
        return written

    def _write(self, path: Path, value: bytes) -> int:
        """Write one chunk file (to a temporary name, fsynced unless ``fsync=False``, renamed); its bytes."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
        try:
            with open(tmp, "xb") as f:
                f.write(value)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return len(value)

    @staticmethod
    def _touch(path: Path) -> int:
        """The file's size after setting its mtime to now, -1 when there is none."""
        try:
            os.utime(path)
            return os.stat(path).st_size
        except FileNotFoundError:
            return -1

    def has(self, keys: list[str]) -> list[int]:
        """Each chunk's size, -1 where absent (touching those that are present)."""
        return [self._touch(self.path(k)) for k in keys]

    def get(self, keys: list[str]) -> list[bytes | None]:
        """Each chunk's bytes, None where absent."""
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self.path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
        return out

    def drop(self, keys: list[str]) -> int:
        """Remove the chunks ``keys``; returns how many there were."""
        removed = 0
        for key in keys:
            try:
                self.path(key).unlink()
                removed += 1
            except FileNotFoundError:
                continue
        return removed

    def sweep(self, named: Iterable[str], grace_s: float) -> int:
        """Remove the chunks not in ``named`` untouched for ``grace_s`` seconds (and temp files as old);
        returns how many chunks were removed."""
        keep = set(named)
        cutoff = time.time() - grace_s
        removed = 0
        try:
            folders = [e for e in os.scandir(self.root) if e.is_dir()]
        except FileNotFoundError:
            return 0
        for folder in folders:
            for entry in os.scandir(folder.path):
                try:
                    if entry.name in keep or entry.stat().st_mtime >= cutoff:
                        continue
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                removed += not entry.name.startswith(_TMP_PREFIX)
        return removed
