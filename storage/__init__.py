"""slotserve's state store: slot metadata plus compressed SES1 blobs, in a local directory
(:class:`DirectoryStore`, the default) or Redis (:class:`RedisStore`, standalone/Sentinel/Cluster).

Modules: ``errors`` (exceptions), ``ses1`` (blob format), ``codec`` (zstd codecs), ``base`` (SlotMeta,
SlotStore protocol), ``directory``, ``redis_store`` + ``redis_url``, ``leases``, ``slot_codec``
(save_slot/load_slot), ``factory`` (open_store).

The names below are imported lazily, so ``import slotstate.ses1`` (e.g. in an engine worker) does not
load redis-py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage.base import SlotMeta, SlotStore
    from storage.directory import DirectoryStore
    from storage.errors import (
        BadStateError,
        FingerprintMismatchError,
        StorageError,
        StoreUnavailableError,
    )
    from storage.factory import open_store
    from storage.redis_store import RedisStore
    from storage.slot_codec import load_slot, save_slot

_EXPORTS = {
    "SlotMeta": "storage.base",
    "SlotStore": "storage.base",
    "DirectoryStore": "storage.directory",
    "RedisStore": "storage.redis_store",
    "open_store": "storage.factory",
    "save_slot": "storage.slot_codec",
    "load_slot": "storage.slot_codec",
    "StorageError": "storage.errors",
    "BadStateError": "storage.errors",
    "FingerprintMismatchError": "storage.errors",
    "StoreUnavailableError": "storage.errors",
}

__all__ = [
    "BadStateError",
    "DirectoryStore",
    "FingerprintMismatchError",
    "RedisStore",
    "SlotMeta",
    "SlotStore",
    "StorageError",
    "StoreUnavailableError",
    "load_slot",
    "open_store",
    "save_slot",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
