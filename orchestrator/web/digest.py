"""Integrity digests of slot states on the wire: RFC 9530 ``Repr-Digest``.

``save-state`` answers with ``Repr-Digest: sha-256=:<base64>:`` (RFC 9530 section 3) over the
SES1 blob it returns: the JSON form always (its ``digest``), the raw form when the request asks with
``Want-Repr-Digest`` (section 4: ``sha-256=10, sha-512=3``, the known algorithm of highest preference
above 0), so a save nobody checks does not hash gigabytes; ``restore-state`` checks a digest the client
sends (the ``Repr-Digest`` request header over the request body, and the JSON form's ``digest`` field over the decoded
state) before anything is restored.  The header is an RFC 8941 Dictionary, parsed with the
``http_sf`` package.  Algorithms: ``sha-256`` and ``sha-512`` (the two RFC 9530 registers as
"Active"); members with other algorithms are ignored, as section 3 allows, but a digest with
none that we know is refused so that a client never believes a state was checked when it was
not.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable

import http_sf

from contract.errors import ErrorCode
from orchestrator.web.errors import ApiError

Buffer = bytes | bytearray | memoryview

ALGORITHMS: dict[str, Callable[[Buffer], hashlib._Hash]] = {"sha-256": hashlib.sha256, "sha-512": hashlib.sha512}


def repr_digest(*chunks: Buffer, algorithm: str = "sha-256") -> str:
    """``<algorithm>=:<base64 of its hash of data>:``, the ``Repr-Digest`` value of ``data``, the
    concatenation of ``chunks`` (hashed in place; ``hashlib`` releases the GIL meanwhile, so
    calling this in a thread keeps the event loop serving); ``algorithm`` a key of :data:`ALGORITHMS`."""
    h = ALGORITHMS[algorithm](b"")
    for chunk in chunks:
        h.update(chunk)
    return f"{algorithm}=:{base64.b64encode(h.digest()).decode('ascii')}:"


def _dictionary(value: str, header: str) -> dict[str, object]:
    """The RFC 8941 Dictionary of header ``header``'s ``value`` (``INVALID_REQUEST`` if it is not one)."""
    try:
        members: object = http_sf.parse(value.encode("ascii"), tltype="dictionary")
    except (ValueError, UnicodeEncodeError) as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{header} is not a structured-field dictionary: {exc}") from exc
    if not isinstance(members, dict):  # what tltype="dictionary" parses to
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{header} is not a structured-field dictionary")
    return members


def wanted_digest(value: str | None) -> str | None:
    """The algorithm a ``Want-Repr-Digest`` request header ``value`` asks for (RFC 9530 section 4: a
    Dictionary of algorithm -> preference 0-10, 0 meaning "not acceptable"): the one of :data:`ALGORITHMS`
    with the highest preference above 0 (``sha-256`` on a tie), or None when the header is absent or asks for
    none of them.  Raises ``ApiError`` ``INVALID_REQUEST`` for a value that is not such a Dictionary."""
    if value is None:
        return None
    try:
        members = http_sf.parse(value.encode("ascii"), tltype="dictionary")
    except (ValueError, UnicodeEncodeError) as exc:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, f"Want-Repr-Digest is not a structured-field dictionary: {exc}"
        ) from exc
    best, best_pref = None, 0
    for algorithm in ALGORITHMS:
        member = members.get(algorithm) if isinstance(members, dict) else None
        pref = member[0] if isinstance(member, tuple) else member
        if not isinstance(pref, int) or isinstance(pref, bool) or not 0 <= pref <= 10:
            if member is not None:
                raise ApiError(ErrorCode.INVALID_REQUEST, f"Want-Repr-Digest {algorithm} must be an integer 0-10")
            continue
        if pref > best_pref:
            best, best_pref = algorithm, pref
    return best


def check_repr_digest(value: str, data: Buffer, what: str) -> None:
    """Check ``data`` against a ``Repr-Digest`` dictionary ``value``.

    Every member with a known algorithm must match.  Raises ``ApiError``:
    ``INVALID_REQUEST`` for a value that is not an RFC 8941 Dictionary of byte sequences or
    names no algorithm of :data:`ALGORITHMS`; ``BAD_STATE`` when a digest differs (``what``
    names the checked bytes in the message).
    """
    members = _dictionary(value, "Repr-Digest")
    checked = 0
    for algorithm, member in members.items():
        expected = member[0] if isinstance(member, tuple) else member  # (value, parameters)
        hasher = ALGORITHMS.get(algorithm)
        if hasher is None:
            continue
        if not isinstance(expected, bytes):
            raise ApiError(ErrorCode.INVALID_REQUEST, f"Repr-Digest {algorithm} must be a byte sequence (:base64:)")
        if hasher(data).digest() != expected:
            raise ApiError(
                ErrorCode.BAD_STATE, f"{what} does not match its {algorithm} digest (damaged in transit or on disk)"
            )
        checked += 1
    if not checked:
        known = ", ".join(ALGORITHMS)
        raise ApiError(ErrorCode.INVALID_REQUEST, f"Repr-Digest names no supported algorithm ({known})")
