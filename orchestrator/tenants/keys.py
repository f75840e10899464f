"""API keys and the tenants they name: the ``--api-keys`` file, ``--api-key`` and ``--admin-key``.

The keys file (docs/operations.md, "Tenants") has one key per line::

    # comment lines and blank lines are skipped
    KEY TENANT            # the user role
    KEY TENANT admin      # the admin role (sees every tenant; the admin API and page)
    sha256:<64 hex> TENANT [admin]

A key written as ``sha256:<hex>`` is the SHA-256 digest of the key a client presents, so the
file need not hold secrets (``printf %s KEY | sha256sum``).  Tenant names are 1-64 characters of
``[A-Za-z0-9._-]``; the role, when given, is ``user`` or ``admin``.  Everything after a ``#``
that begins a word is a comment.  A line that breaks these rules, or a key listed twice, is
refused with its file name and line number (:class:`KeysFileError`): the server does not start
with it, and a reload (SIGHUP) that finds it keeps the keys it had.

A presented key is looked up by its SHA-256 digest (:class:`KeyRing`), so no comparison of the
key itself takes a time that depends on how much of it is right.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

import structlog

from orchestrator.tenants.principal import DEFAULT_TENANT, Principal

log = structlog.get_logger("slotserve.tenants")

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""What a tenant name may be (a store key, a metrics label and a slot file name carry it)."""

_SHA256 = re.compile(r"sha256:([0-9a-fA-F]{64})")


class KeysFileError(ValueError):
    """A keys file that cannot be used: ``FILE:LINE: what is wrong`` (never the key itself)."""


def digest(key: str) -> bytes:
    """The SHA-256 digest (32 bytes) of a key as a client presents it (UTF-8)."""
    return hashlib.sha256(key.encode()).digest()


def check_tenant(name: str) -> str:
    """``name`` if it is a valid tenant name (see :data:`TENANT_NAME`), else ``ValueError``."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"bad tenant name {name[:70]!r}: 1-64 characters of A-Z a-z 0-9 . _ -")
    return name


def parse_keys(text: str, source: str = "<keys>") -> dict[bytes, Principal]:
    """The principals of a keys file's ``text`` (format: module docstring), keyed by the key's
    SHA-256 digest.  Raises :class:`KeysFileError` naming ``source`` and the line."""
    out: dict[bytes, Principal] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = []
        for word in line.split():
            if word.startswith("#"):
                break
            words.append(word)
        if not words:
            continue
        where = f"{source}:{n}"
        if len(words) not in (2, 3):
            raise KeysFileError(f"{where}: expected 'KEY TENANT' or 'KEY TENANT admin', got {len(words)} words")
        key, tenant = words[0], words[1]
        role = words[2] if len(words) == 3 else "user"
        if role not in ("user", "admin"):
            raise KeysFileError(f"{where}: the role is 'user' or 'admin', not {role[:20]!r}")
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise KeysFileError(f"{where}: {exc}") from None
        if key.lower().startswith("sha256:"):
            m = _SHA256.fullmatch(key)
            if m is None:
                raise KeysFileError(f"{where}: a sha256: key is 64 hexadecimal digits after 'sha256:'")
            d = bytes.fromhex(m.group(1))
        else:
            d = digest(key)
        if d in out:
            raise KeysFileError(f"{where}: this key is listed twice")
        out[d] = Principal(tenant=tenant, admin=role == "admin")
    return out


def read_keys_file(path: Path) -> dict[bytes, Principal]:
    """:func:`parse_keys` of the file at ``path`` (:class:`KeysFileError` also when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"{path}: cannot read the keys file: {exc}") from None
    return parse_keys(text, str(path))


class KeyRing:
    """Every key the server accepts, and the principal each one names.

    ``api_key`` (``--api-key``) is the :data:`DEFAULT_TENANT`; it has the admin role only when it is
    the one key there is (no ``--admin-key``, no keys file), as before tenants existed.
    ``admin_key`` (``--admin-key``) is the admin of :data:`DEFAULT_TENANT`.  ``keys_file``
    (``--api-keys``) is read now (:class:`KeysFileError`) and again by :meth:`reload` (SIGHUP).
    """

    def __init__(self, api_key: str | None = None, admin_key: str | None = None, keys_file: Path | None = None):
        self.keys_file = keys_file
        fixed: dict[bytes, Principal] = {}
        if admin_key:
            fixed[digest(admin_key)] = Principal(DEFAULT_TENANT, admin=True)
        if api_key:
            fixed[digest(api_key)] = Principal(DEFAULT_TENANT, admin=not admin_key and keys_file is None)
        self._fixed = fixed
        self._keys = self._merged(read_keys_file(keys_file) if keys_file is not None else {})

    @property
    def configured(self) -> bool:
        """True when any key is configured: requests must then present one."""
        return bool(self._fixed) or self.keys_file is not None

    def __len__(self) -> int:
        return len(self._keys)

    def _merged(self, from_file: dict[bytes, Principal]) -> dict[bytes, Principal]:
        return {**from_file, **self._fixed}  # --api-key / --admin-key win over a line naming the same key

    def lookup(self, presented: Iterable[str]) -> Principal | None:
        """The principal of the first presented key that is known (None: none is)."""
        keys = self._keys
        for key in presented:
            found = keys.get(digest(key))
            if found is not None:
                return found
        return None

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP); on a bad file log why and keep the keys in use.
        True when the new keys were taken."""
        if self.keys_file is None:
            return False
        try:
            fresh = self._merged(read_keys_file(self.keys_file))
        except KeysFileError as exc:
            log.error("keys file not reloaded; the previous keys stay in use", error=str(exc))
            return False
        self._keys = fresh  # one assignment: a request sees the old keys or the new
        log.info("keys file reloaded", keys=len(fresh), tenants=len({p.tenant for p in fresh.values()}))
        return True
