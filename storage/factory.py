"""Pick and build a slot store from configuration."""

from __future__ import annotations

from pathlib import Path

from storage.base import DEFAULT_CHUNK_SIZE, DEFAULT_PREFIX, SlotStore
from storage.directory import DirectoryStore
from storage.redis_store import RedisStore

__all__ = ["REDIS_SCHEMES", "open_store"]

REDIS_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
)


def open_store(
    url: str | None,
    directory: Path | str,
    *,
    prefix: str = DEFAULT_PREFIX,
    ttl_s: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> SlotStore:
    """A :class:`RedisStore` if ``url`` has a Redis scheme (see :mod:`storage.redis_url`), a
    :class:`DirectoryStore` at ``url``'s path for ``file://`` URLs, else (``url`` None/empty) a
    DirectoryStore at ``directory``. Nothing is contacted yet: call ``ping()``.

    Raises:
        ValueError: unsupported URL scheme.
    """
    if not url:
        return DirectoryStore(directory, prefix=prefix, ttl_s=ttl_s, chunk_size=chunk_size)
    scheme = url.partition("://")[0].lower()
    if scheme == "file":
        return DirectoryStore(url.partition("://")[2], prefix=prefix, ttl_s=ttl_s, chunk_size=chunk_size)
    if scheme in REDIS_SCHEMES:
        return RedisStore.from_url(url, prefix=prefix, ttl_s=ttl_s, chunk_size=chunk_size)
    raise ValueError(f"unsupported store URL {url!r}: expected file:// or one of {REDIS_SCHEMES}")
