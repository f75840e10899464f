"""Stop strings kept out of the text a client receives.

:class:`StopTextFilter` holds back streamed text that may be the start of a stop string,
so the stop string itself never reaches the client: what llama-server and OpenAI always
do, and KoboldCpp with ``trim_stop`` (``koboldcpp.py`` ``handle_sse_stream``).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopTextFilter:
    """Releases generated text except what may still become a stop string.

    ``feed(text)`` returns the text now safe to send; ``finish(stop)`` returns the rest,
    cut before ``stop`` when the generation ended on that stop string.  Concatenating
    every return value gives the output with the stop string and all after it removed.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> str:
        """Text that can be sent now."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut = len(self.pending)
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                cut = min(cut, i)
                continue
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    cut = min(cut, len(self.pending) - k)
                    break
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    @classmethod
    def whole(cls, stops: list[str], texts: Iterable[str], stop: str = "") -> str:
        """The whole output of a generation that was not streamed: ``texts`` (its tokens' text) as a
        stream through a filter of ``stops`` would release them, ending on ``stop``."""
        filt = cls(stops)
        return "".join(filt.feed(t) for t in texts) + filt.finish(stop)

    def finish(self, stop: str = "") -> str:
        """The held-back text at the end, without ``stop`` and what follows it."""
        rest, self.pending = self.pending, ""
        if stop:
            i = rest.find(stop)
            if i >= 0:
                return rest[:i]
        return rest


def trim_stop(text: str, stop: str) -> str:
    """``text`` cut before the first ``stop`` (unchanged when ``stop`` is empty or absent)."""
    i = text.find(stop) if stop else -1
    return text[:i] if i >= 0 else text
