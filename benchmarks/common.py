"""Helpers shared by the benchmarks: CPU accounting and the idle guard, prompts, streams (server
processes: servers.py).

Every benchmark measures its figures side by side in one run and reports medians. On a shared
machine other jobs distort everything (a 2-thread llama.cpp decode slows down many times when a
core is taken), so each measured rep waits for the machine to go idle (``--wait-idle``) and is
redone while processes outside the benchmark used more than ``--max-other`` cores meanwhile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")

TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home. "
    "Later, towers of stone carried lanterns, and mirrors focused their light across the water. "
    "Keepers trimmed the wicks every night, recorded the weather, and rescued sailors from wrecks. "
    "In the nineteenth century the Fresnel lens made the beams visible for many miles, "
    "and clockwork turned the lens so that each station had its own pattern of flashes. "
    "Today most lights are automatic, yet people still visit them to remember the keepers. "
)
_SENTENCES = [s.strip() + "." for s in TEXT.split(". ") if s.strip()]
TOPICS = ["lighthouses", "bridges", "canals", "windmills", "railways", "harbours", "observatories", "libraries"]


def machine() -> str:
    """CPU model and core count of this machine (``/proc/cpuinfo``)."""
    name = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores"


def load() -> str:
    """The load average (1, 5, 15 min), printed beside every figure."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- CPU accounting


def proc_cpu(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def system_busy() -> float:
    """CPU seconds all processes of this machine have used since boot (user+nice+system+irq+softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / CLK_TCK


def steal_time() -> float:
    """CPU seconds the hypervisor gave to other guests since boot (``steal`` in /proc/stat): on a
    VM, host contention slows every figure down without showing up as another process's load."""
    with open("/proc/stat") as f:
        v = f.readline().split()
    return int(v[8]) / CLK_TCK if len(v) > 8 else 0.0


def wait_idle(max_wait: float, threshold: float = 0.15, window: float = 1.0) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` cores over ``window`` s.

    "Other" is every process but this one, so it includes the servers under test: this also waits
    for their background work (write-behind saves) to end. Returns the load (cores) of the last window.
    """
    deadline = time.monotonic() + max_wait
    while True:
        b0, c0, t0 = system_busy(), time.process_time(), time.perf_counter()
        time.sleep(window)
        load = ((system_busy() - b0) - (time.process_time() - c0)) / (time.perf_counter() - t0)
        if load < threshold or time.monotonic() >= deadline:
            return load


class CpuMeter:
    """CPU seconds of named processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0: dict[str, float] = {}
        self.marks: dict[str, dict[str, float]] = {}

    def mark(self, name: str) -> None:
        """Snapshot now (``first`` / ``last`` token: the decode window)."""
        self.marks[name] = self._now()

    def _now(self) -> dict[str, float]:
        out = {
            "client": time.process_time(),
            "_system": system_busy(),
            "_steal": steal_time(),
            "_wall": time.perf_counter(),
        }
        for name, pid in self.pids.items():
            try:
                out[name] = proc_cpu(pid)
            except OSError:  # exited
                out[name] = self.t0.get(name, 0.0)
        return out

    def start(self) -> None:
        self.marks = {}
        self.t0 = self._now()

    def stop(self) -> dict[str, float]:
        """CPU seconds per process, plus ``other``: cores used by every other process meanwhile."""
        t1 = self._now()
        d = {k: t1[k] - self.t0[k] for k in t1}
        ours = sum(v for k, v in d.items() if not k.startswith("_"))
        wall, system, steal = d.pop("_wall"), d.pop("_system"), d.pop("_steal")
        d["other"] = max(0.0, (system - ours) / wall) if wall > 0 else 0.0
        d["steal"] = steal / wall if wall > 0 else 0.0
        a, b = self.marks.get("first"), self.marks.get("last")
        if a is not None and b is not None:  # CPU seconds of each process between first and last token
            for k in a:
                if not k.startswith("_"):
                    d["decode:" + k] = b[k] - a[k]
        return d


def add_idle_args(ap: argparse.ArgumentParser, wait_idle_s: float = 120, max_other: float = 0.1) -> None:
    """``--wait-idle``, ``--max-other``, ``--retries`` (see :func:`quiet`)."""
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=wait_idle_s,
        help="before each measured rep wait up to this many s for other processes to go idle (0: don't)",
    )
    ap.add_argument("--max-other", type=float, default=max_other, help="redo a rep if others used more cores than this")
    ap.add_argument("--retries", type=int, default=5, help="redos per rep at most")


def add_gpu_args(ap: argparse.ArgumentParser) -> None:
    """``--n-gpu-layers`` (slotserve's worker, in-process engines and llama-server alike)."""
    ap.add_argument(
        "--n-gpu-layers", "-ngl", type=int, default=0, help="layers offloaded to a GPU (slotserve and llama-server)"
    )


class Quiet:
    """Runs measurements on an idle machine (see :meth:`run`); counts the redone ones."""

    def __init__(self, args: argparse.Namespace, pids: dict[str, int] | None = None) -> None:
        self.args = args
        self.meter = CpuMeter(pids or {})
        self.redone = 0
        self.worst_other = 0.0
        self.steal: list[float] = []

    def wait(self) -> None:
        """Wait (up to ``--wait-idle`` s) for the machine to go idle."""
        if self.args.wait_idle > 0:
            wait_idle(self.args.wait_idle, window=0.5)

    def run(
        self, fn: Callable[[], T], label: str = "", warm: bool = False, wait: bool = True
    ) -> tuple[T, dict[str, float]]:
        """``fn()`` after waiting for the machine to go idle (unless not ``wait``: for a series of short
        calls after one :meth:`wait`); redone (up to ``--retries`` times, after a wait) while other
        processes used more than ``--max-other`` cores meanwhile. A warm-up (``warm``) runs once without
        waiting. Returns ``(result, cpu)``, ``cpu`` as :meth:`CpuMeter.stop` gives it (``fn`` may call
        ``self.meter.mark``)."""
        tries = 1 if warm else 1 + self.args.retries
        for attempt in range(tries):
            if not warm and (wait or attempt):
                self.wait()
            self.meter.start()
            w0 = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - w0
            cpu = self.meter.stop()
            other = cpu["other"]
            if warm:
                return out, cpu
            # /proc/stat counts in clock ticks (10 ms): over a short call, one tick of anyone's work looks
            # like a whole core, so allow two ticks of error (short calls rely on wait_idle before them)
            tolerance = 2 / CLK_TCK / max(wall, 1e-3)
            if other <= self.args.max_other + tolerance or attempt == tries - 1:
                self.worst_other = max(self.worst_other, other - tolerance)
                if wall >= 0.5:  # ticks again
                    self.steal.append(cpu["steal"])
                return out, cpu
            self.redone += 1
            print(f"    {label}: other processes used {other:.2f} cores: measuring again", flush=True)
        raise AssertionError("unreachable")

    def summary(self) -> str:
        warn = "  <-- WARNING: machine shared, figures distorted" if self.worst_other > 0.2 else ""
        steal = (
            f"; steal time (VM host) median {median(self.steal):.2f}, worst {max(self.steal):.2f} cores"
            if self.steal
            else ""
        )
        return (
            f"load of other processes during measured reps (beyond clock-tick resolution): worst "
            f"{self.worst_other:.2f} cores, {self.redone} reps redone because of it{warn}{steal}"
        )


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def token_gaps(times: Iterable[float]) -> list[float]:
    """Intervals between consecutive token arrival times (s)."""
    return [b - a for a, b in itertools.pairwise(times)]


def step_tps(gaps: Iterable[float]) -> float:
    """Decode tok/s from the median interval between consecutive tokens (s), pooled over reps: the
    typical step, where a rep's tok/s also carries every burst of other work on the machine (on the
    project's 2-core VM the tok/s of identical reps spread by +-10%, their median steps by ~1%)."""
    m = median(gaps)
    return 1 / m if m > 0 else float("nan")


# ----------------------------------------------------------------------------- prompts


Tokenize = Callable[[str, bool], list[int]]
"""``tokenize(text, parse_special) -> ids`` (no BOS added)."""


def build_prompt(tokenize: Tokenize, n: int, variant: int = 0) -> list[int]:
    """Exactly ``n`` token ids: a chat turn whose user message is cut to fit.

    ``variant`` 0 is the benchmarks' original prompt; other variants change the topic and rotate the
    sentences, so prompts of different variants differ from their first tokens on (no shared prefix).
    """
    if variant == 0:
        head = tokenize("<|im_start|>user\nSummarize this text.\n\n", True)
    else:
        topic = TOPICS[variant % len(TOPICS)]
        head = tokenize(f"<|im_start|>user\nRequest {variant}: summarize this text about {topic}.\n\n", True)
    tail = tokenize("<|im_end|>\n<|im_start|>assistant\n", True)
    body: list[int] = []
    k = 1
    while len(head) + len(body) + len(tail) < n:
        if variant == 0:
            body += tokenize(f"Part {k}. {TEXT}", False)
        else:
            r = (variant + k) % len(_SENTENCES)
            text = " ".join(_SENTENCES[r:] + _SENTENCES[:r])
            body += tokenize(f"Part {k} of text {variant}. {text} ", False)
        k += 1
    body = body[: max(0, n - len(head) - len(tail))]
    ids = (head + body + tail)[-n:]
    assert len(ids) == n
    return ids


def model_tokenizer(model) -> Tokenize:
    """A :data:`Tokenize` over an in-process ``engine.model.Model``."""
    return lambda text, special: model.tokenize(text, False, special)


def http_tokenizer(client, base: str) -> Tokenize:
    """A :data:`Tokenize` over a slotserve's ``POST /api/v1/tokenize``."""

    def tok(text: str, special: bool) -> list[int]:
        body = {"text": text, "parse_special": special, "add_special_tokens": False, "with_pieces": False}
        r = client.post(base + "/api/v1/tokenize", json=body)
        r.raise_for_status()
        return r.json()["token_ids"]

    return tok


def user_turn(tokenize: Tokenize, text: str) -> list[int]:
    """A user message and the assistant header (what a client appends to a conversation)."""
    return tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", True)


# ----------------------------------------------------------------------------- clients


class SseEvents:
    """Splits a server-sent-events byte stream into the JSON payloads of its events' ``data:``
    lines (events end at a blank line; llama-server's ``[DONE]`` is dropped)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> list[dict]:
        """The events completed by ``chunk``."""
        start = max(0, len(self.buf) - 1)
        self.buf += chunk
        out: list[dict] = []
        while (i := self.buf.find(b"\n\n", start)) >= 0:
            event, start = bytes(self.buf[:i]), 0
            del self.buf[: i + 2]
            data = b"".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                out.append(json.loads(data))
        return out


async def sse_events(resp) -> AsyncIterator[dict]:
    """The JSON payloads of an ``httpx`` async streaming response's SSE events (see :class:`SseEvents`)."""
    events = SseEvents()
    async for chunk in resp.aiter_bytes():
        for ev in events.feed(chunk):
            yield ev


def prefix_len(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


async def ws_token_frames(ws, attention: bool = True) -> AsyncIterator[tuple[dict, bytes | None]]:
    """The binary WebSocket's frames from a ``websockets`` connection: ``(token event, its binary attention
    frame)`` per token (``b""`` when the request asked for no ``attention``: no binary frames come),
    then ``(done event, None)``. An error event raises RuntimeError."""
    pending = None
    while True:
        msg = await ws.recv()
        if isinstance(msg, str):
            ev = json.loads(msg)
            if ev["type"] == "token" and not attention:
                yield ev, b""
            elif ev["type"] == "token":
                pending = ev
            elif ev["type"] == "done":
                yield ev, None
                return
            else:
                raise RuntimeError(f"ws: {ev}")
        elif pending is None:
            raise RuntimeError("ws: binary frame before its token frame")
        else:
            yield pending, msg
            pending = None
