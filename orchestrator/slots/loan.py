"""A slot's state lent out for reading: the buffer goes back when the borrower's block ends.

The engine client receives a sequence state (``llama_state_seq_get_data``'s bytes, tens of MB)
into a buffer of its receive pool; handed back, the next state arrives in it without a fresh
allocation (:meth:`orchestrator.engine_client.interface.EngineClient.release_state`).
:class:`StateLoan` owns that duty: :meth:`orchestrator.slots.registry.SlotRegistry.lend_state`
yields one inside ``async with`` and gives the buffer back on leaving, whatever happened.  An
answer that streams the bytes after the handler returned takes the duty over once, with
:meth:`StateLoan.hand_off`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from contract.framing import Buffer
from slotstate.ses1 import HEADER_SIZE, ses1_header


@dataclass
class StateLoan:
    """A slot's tokens and llama.cpp sequence state (``state``, in the buffer it arrived in), and
    how long producing it took (``t_ms``, ms).  ``n_tokens`` and ``ses1_size`` (bytes) are taken
    when lent, so they stay readable after the buffer went back."""

    tokens: list[int]
    state: Buffer
    t_ms: float
    give_back: Callable[[Buffer], None] | None = None
    ses1_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.ses1_size = HEADER_SIZE + 4 * len(self.tokens) + memoryview(self.state).nbytes

    @property
    def n_tokens(self) -> int:
        """Tokens of the state."""
        return len(self.tokens)

    def ses1_chunks(self) -> list[Buffer]:
        """The SES1 blob (:mod:`slotstate.ses1`) as two chunks to send in order (the state not copied)."""
        return [ses1_header(self.tokens), self.state]

    def release(self) -> None:
        """Give the buffer back (once; later calls do nothing)."""
        give, self.give_back = self.give_back, None
        if give is not None:
            give(self.state)

    def hand_off(self) -> Callable[[], None]:
        """Take over giving the buffer back (for an answer sent after the lending block ends): the
        block's end no longer does; call the returned function once the bytes are sent."""
        taken = [(self.give_back, self.state)] if self.give_back is not None else []
        self.give_back = None

        def done() -> None:
            while taken:
                give, state = taken.pop()
                give(state)

        return done


@asynccontextmanager
async def lent(produce: Awaitable[StateLoan | None]) -> AsyncIterator[StateLoan | None]:
    """Await ``produce`` and yield its loan (None: no state), given back when the block ends."""
    loan = await produce
    try:
        yield loan
    finally:
        if loan is not None:
            loan.release()
