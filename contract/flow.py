"""Flow control of one generation: how far the worker may run ahead of the client of a stream.

The orchestrator opens a generation with a window (:class:`contract.protocol.Generate`,
``window`` tokens and ``window_bytes`` bytes) and acknowledges what its client has taken
(:class:`contract.protocol.Ack`, a count of tokens).  The worker keeps one :class:`Credit` per
generation and does not decode a generation whose credit is spent (``Batcher.held`` in
:mod:`engine.batcher`): its sequence waits, the others go on, until an ``Ack`` or a cancel.
What the orchestrator holds for a slow client is then bounded by the window, whatever the
client's speed (docs/architecture.md, "Flow control").

The defaults below are the orchestrator's (``--stream-window``, ``--stream-window-bytes``
in ``orchestrator/config.py``; docs/operations.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_TOKENS = 4
"""Tokens a generation may run ahead of its client by default.  An ``Ack`` crosses the socket in
well under one decode step, so a client that keeps up is never held by four."""

WINDOW_BYTES = 16 << 20
"""Bytes of tensors (attention rows, hidden states) a generation may run ahead of its client by
default.  Per-layer float32 attention is ``4 * n_layers * n_heads * n_ctx`` bytes a token (2.2 MB
for SmolLM2-135M at 2,000 tokens of context, 128 MiB for a 32-layer, 32-head model at 8,192), so
for large models or contexts this, not :data:`WINDOW_TOKENS`, is the bound; one token is always
allowed however large its tensors."""


@dataclass
class Credit:
    """What one generation has emitted and what its client has taken.

    ``window``: tokens at most emitted and not acknowledged; ``window_bytes``: their tensor
    bytes at most (a token is emitted while less than that is outstanding, so the outstanding
    bytes stay under ``window_bytes`` plus one token's).  0 turns either bound off.
    """

    window: int = 0
    window_bytes: int = 0
    emitted: int = 0  # tokens emitted
    acked: int = 0  # tokens the client has taken (the largest ``Ack.n`` so far, at most ``emitted``)
    outstanding_bytes: int = 0  # tensor bytes of the tokens emitted and not yet taken
    _sizes: deque[int] = field(default_factory=deque)  # tensor bytes of each token not yet taken

    @property
    def outstanding(self) -> int:
        """Tokens emitted that the client has not taken yet."""
        return self.emitted - self.acked

    def emit(self, n_bytes: int) -> None:
        """Count one emitted token whose tensors are ``n_bytes`` bytes."""
        self.emitted += 1
        self._sizes.append(n_bytes)
        self.outstanding_bytes += n_bytes

    def ack(self, n: int) -> None:
        """The client has taken its first ``n`` tokens.  An older (smaller) count, or one past the
        tokens emitted (a confused sender), moves nothing back nor forward beyond what was emitted."""
        while self.acked < min(n, self.emitted):
            self.outstanding_bytes -= self._sizes.popleft()
            self.acked += 1

    def spent(self) -> bool:
        """True when no further token may be emitted until an ``ack``."""
        if 0 < self.window <= self.outstanding:
            return True
        return 0 < self.window_bytes <= self.outstanding_bytes  # never with nothing outstanding


def ack_due(unacked: int, unacked_bytes: int, window: int, window_bytes: int) -> bool:
    """Whether the orchestrator acknowledges now, its client having taken ``unacked`` tokens (``unacked_bytes``
    bytes of tensors) since its last ``Ack``: once half of either bound of the window is taken (every token
    with a window of 1 or 2), so one ``Ack`` covers several tokens and the worker's reader wakes less often.

    Never a deadlock: the worker holds a generation only while ``window`` tokens or ``window_bytes`` bytes
    are outstanding (:meth:`Credit.spent`); a client that has taken all of them has then taken at least half
    of that bound, so this says yes.  Both bounds 0 (unknown): every token is acknowledged.
    """
    if window <= 0 and window_bytes <= 0:
        return unacked > 0
    by_tokens = window > 0 and unacked >= max(1, window // 2)
    return by_tokens or (window_bytes > 0 and unacked_bytes >= max(1, window_bytes // 2))
