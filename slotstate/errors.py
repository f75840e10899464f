"""The one error every reader of slot-state bytes raises, and its fingerprint variant.

Raised by the SES1 envelope (:mod:`slotstate.ses1`), the store codecs (:mod:`slotstate.codec`),
llama.cpp's sequence-state parser (:mod:`slotstate.seq_state`), the ``ggsq`` slot files
(:mod:`slotstate.ggsq`) and the stores (``storage``). The orchestrator reports it as ``BAD_STATE``
and leaves the slot as it was.
"""

from __future__ import annotations

__all__ = ["BadStateError", "FingerprintMismatchError"]


class BadStateError(ValueError):
    """A state blob or its metadata is malformed, truncated, corrupt or inconsistent: not a state
    this engine can restore."""


class FingerprintMismatchError(BadStateError):
    """A stored slot belongs to a different model fingerprint than the one asking for it.

    Attributes:
        slot_id: the slot that was asked for.
        expected: the fingerprint of the caller's model.
        found: the fingerprint recorded in the slot's metadata.
    """

    def __init__(self, slot_id: str, expected: str, found: str) -> None:
        super().__init__(
            f"slot {slot_id!r} was saved by model fingerprint {found!r}, not {expected!r}; refusing to load it"
        )
        self.slot_id = slot_id
        self.expected = expected
        self.found = found
