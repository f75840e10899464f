"""The worker's replies to its orchestrator, in order, with bulk bytes written off the decode thread.

Every reply frame (:mod:`contract.framing`: a small msgpack header and raw buffers) goes through one
:class:`Outbox`.  A frame with little to carry (under :data:`BULK_BYTES` of buffers) is written at once by
the thread that sends it, as long as nothing is queued before it: a token without tensors costs one
``sendmsg``, as it did.  A frame that carries more (a sequence's state, 46 MB for SmolLM2-135M at 2,000
tokens; the KV records of a strict commit; a token's full attention rows, 2.2 MB at 2,000 tokens), and every
frame that finds others queued (order is kept), is queued for the ``worker-writer`` thread, which copies its
buffers into the shared region (:mod:`contract.shm`) when there is one with room and writes the frame.
So the decode thread never blocks on the socket, nor copies, for bulk bytes: a save's blob goes out while
the other sequences decode.

What is queued is bounded by what produced it: a generation's tokens by its flow-control window
(:mod:`contract.flow`), states and KV records by the orchestrator's requests (one at a time per slot).  A
buffer handed to :meth:`Outbox.send` must not change until its frame is written; ``done`` is called then
(or when the frame is dropped because the peer is gone or the outbox closed), on whichever thread wrote it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contract import protocol as proto
from contract.framing import frame_chunks, send_chunks, shared_frame_chunks
from contract.shm import RegionWriter

log = logging.getLogger("slotserve.worker")

BULK_BYTES = 1 << 20
"""Bytes of buffers from which a frame is written by the writer thread rather than by its sender."""


@dataclass
class _Frame:
    meta: bytes
    buffers: Sequence[proto.Buffer]
    shareable: bool  # a token's: its buffers may go through the shared region
    done: Callable[[], None] | None


class Outbox:
    """Writes reply frames to ``sock`` in the order :meth:`send` is called (thread-safe).

    ``shared``: the region tokens' tensors go through (a token's buffers are copied there when it has room,
    else sent inline).  Once the socket fails, every later frame is dropped and :meth:`send` raises the
    ``OSError`` (the peer is gone; the worker's reader sees the stream close and stops the worker).
    """

    def __init__(self, sock: socket.socket, shared: RegionWriter | None = None) -> None:
        self.sock = sock
        self.shared = shared
        self._cond = threading.Condition()
        self._queue: deque[_Frame] = deque()
        self._writing = False  # the writer thread is writing a frame it took off the queue
        self._closed = False
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="worker-writer", daemon=True)
        self._thread.start()

    def send(
        self, msg: proto.Message, buffers: Sequence[proto.Buffer] = (), done: Callable[[], None] | None = None
    ) -> None:
        """Write ``msg`` and its raw ``buffers`` as one frame: now (a small frame, nothing queued) or on the
        writer thread.  Raises the socket's ``OSError`` once it has failed (``done`` is still called); a
        frame sent after :meth:`close` is dropped."""
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        frame = _Frame(proto.encode_meta(msg), buffers, isinstance(msg, proto.Token) and nbytes > 0, done)
        with self._cond:
            if self._error is not None or self._closed:
                _finish(frame)
                if self._error is not None:
                    raise OSError(f"the orchestrator's stream failed: {self._error}")
                return
            if nbytes >= BULK_BYTES or self._queue or self._writing:
                self._queue.append(frame)
                self._cond.notify_all()
                return
            try:  # under the lock: no other frame can start before this one ends
                self._write(frame)
            except OSError as exc:
                self._error = exc
                raise
            finally:
                _finish(frame)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (for at most ``timeout`` seconds), then stop the writer thread; later frames
        are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and written out
                frame = self._queue.popleft()
                self._writing = self._error is None
            try:
                if self._writing:
                    self._write(frame)
            except OSError as exc:
                log.info("worker output closed: %s", exc)
                with self._cond:
                    self._error = exc
            finally:
                _finish(frame)
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, frame: _Frame) -> None:
        spans = None
        if self.shared is not None and frame.shareable:
            spans = self.shared.place([memoryview(b) for b in frame.buffers])
        if spans is not None:
            send_chunks(self.sock, shared_frame_chunks(frame.meta, spans))
        else:
            send_chunks(self.sock, frame_chunks(frame.meta, frame.buffers))


def _finish(frame: _Frame) -> None:
    if frame.done is not None:
        frame.done()
