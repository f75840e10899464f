"""Frames on the worker's stream, and worker addresses.

A frame is one msgpack-encoded message (:mod:`contract.protocol`) followed by the raw byte
buffers it describes (little-endian)::

    u32 meta_len | u16 n_bufs | u16 flags | u64 buf_len[n_bufs] | meta (msgpack) | buf_0 ... buf_{n-1}

Buffers are written with a gathered ``sendmsg`` (never copied, never base64, never
pickled).  With ``flags`` :data:`FLAG_SHARED` (a worker to the orchestrator that spawned it) the
buffers are in the shared region instead (:mod:`contract.shm`) and the frame carries only where::

    u32 meta_len | u16 n_bufs | u16 flags(1) | (u64 offset, u64 length)[n_bufs] | meta (msgpack)

The worker reads frames from a blocking socket (:func:`recv_frame`); the orchestrator's end is
:class:`FrameStream`, an ``asyncio.BufferedProtocol``: ``asyncio.StreamReader`` would copy every
byte three times (into its growing buffer, out with ``readexactly``, then the memmove of
``del buffer[:n]``) and move a state of tens of MB in 64 KiB steps; here small frames land in one
reused staging buffer and a large raw buffer straight in the ``bytearray`` the caller receives, so a
state is copied once, by the kernel.

A message describes each of its buffers with a :class:`Tensor` (index, dtype, shape).
This module knows nothing of the messages themselves; it moves bytes.
"""

from __future__ import annotations

import asyncio
import collections
import math
import socket
import struct
from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec

from contract.buffers import BufferPool

_HEAD = struct.Struct("<IHH")
_LEN = struct.Struct("<Q")
MAX_META_BYTES = 64 << 20
MAX_BUF_BYTES = 8 << 30
FLAG_SHARED = 1
"""Frame flag: the buffers are ``(offset, length)`` ranges of the shared region (:mod:`contract.shm`)."""
POOLED_BYTES = 1 << 20
"""Buffers this big or bigger are received into a :class:`contract.buffers.BufferPool`'s memory."""

Buffer = bytes | bytearray | memoryview
"""A raw buffer: anything exposing the buffer protocol as bytes (an array's: its ``.data``)."""

RecvBuffer = bytearray | memoryview
"""A received raw buffer: a bytearray of its own, or a view of pooled memory (:data:`POOLED_BYTES`)."""


class ProtocolError(RuntimeError):
    """The peer sent a malformed frame or message, or closed the stream mid-frame."""


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


Dtype = Literal["float32", "float16", "int32", "uint8"]
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "int32": 4, "uint8": 1}


class Tensor(msgspec.Struct, array_like=True, frozen=True):
    """A raw buffer of the frame: ``buf`` (its index among the frame's buffers), ``dtype``
    and ``shape`` (C order, little-endian)."""

    buf: NonNegInt
    dtype: Dtype
    shape: tuple[NonNegInt, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the buffer must hold: ``prod(shape) * itemsize``."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @classmethod
    def of(cls, array: object, buf: int) -> Tensor:
        """The description of a C-contiguous numpy ``array`` sent as buffer ``buf`` (ValueError for another dtype)."""
        dtype = str(array.dtype)  # type: ignore[attr-defined]
        if dtype not in ITEMSIZE:
            raise ValueError(f"no {dtype} tensors in the protocol: {sorted(ITEMSIZE)}")
        return cls(buf, dtype, tuple(array.shape))  # type: ignore[attr-defined, arg-type]

    @classmethod
    def raw(cls, data: Buffer, buf: int = 0) -> Tensor:
        """The description of opaque bytes (``uint8[nbytes]``) sent as buffer ``buf``."""
        return cls(buf, "uint8", (memoryview(data).nbytes,))

    def take(self, bufs: Sequence[Buffer]) -> Buffer:
        """This tensor's buffer out of a frame's ``bufs``; ProtocolError when it is missing or
        its size is not ``nbytes``."""
        if self.buf >= len(bufs):
            raise ProtocolError(f"tensor names buffer {self.buf} of a frame with {len(bufs)}")
        data = bufs[self.buf]
        if memoryview(data).nbytes != self.nbytes:
            raise ProtocolError(f"buffer {self.buf} holds {memoryview(data).nbytes} bytes, {self} needs {self.nbytes}")
        return data


def parse_address(addr: str) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
    """``unix:/path`` or ``tcp:host:port`` (a worker's address) to ``(family, sockaddr)``.

    Raises ValueError for any other form (or a port that is not a number).
    """
    kind, _, rest = addr.partition(":")
    if kind == "unix" and rest:
        return socket.AF_UNIX, rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return socket.AF_INET, (host or "127.0.0.1", int(port))
    raise ValueError(f"bad address {addr!r}: use unix:/path or tcp:host:port")


def frame_chunks(meta: bytes, buffers: Sequence[Buffer] = ()) -> list[Buffer]:
    """The frame of encoded ``meta`` and its raw ``buffers`` as byte chunks (for ``sendmsg``/``writelines``)."""
    views = [memoryview(b).cast("B") for b in buffers]
    head = _HEAD.pack(len(meta), len(views), 0) + b"".join(_LEN.pack(v.nbytes) for v in views)
    return [head, meta, *views]


def shared_frame_chunks(meta: bytes, spans: Sequence[tuple[int, int]]) -> list[Buffer]:
    """The frame of encoded ``meta`` whose buffers are ``(offset, length)`` ranges of the shared region."""
    table = b"".join(_LEN.pack(o) + _LEN.pack(n) for o, n in spans)
    return [_HEAD.pack(len(meta), len(spans), FLAG_SHARED) + table, meta]


def send_chunks(sock: socket.socket, chunks: Sequence[Buffer]) -> None:
    """Write byte chunks to a blocking socket (gathered write; a partial write goes on without copying)."""
    views = [memoryview(c).cast("B") for c in chunks]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views:
            views[0] = views[0][sent:]


def _recv_exact(sock: socket.socket, n: int, pool: BufferPool | None = None) -> bytearray | memoryview:
    if pool is not None and n >= POOLED_BYTES:
        view = pool.take(n)
        buf: bytearray | memoryview = view
    else:
        buf = bytearray(n)
        view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError("peer closed the stream")
        got += k
    return buf


def _check_sizes(meta_len: int, lens: Sequence[int]) -> None:
    if meta_len > MAX_META_BYTES or any(n > MAX_BUF_BYTES for n in lens):
        raise ProtocolError(f"frame too large: meta={meta_len} bufs={list(lens)}")


def recv_frame(
    sock: socket.socket, pool: BufferPool | None = None
) -> tuple[bytearray | memoryview, list[bytearray | memoryview]]:
    """Read one frame from a blocking socket: ``(meta, buffers)``; ProtocolError when malformed or cut.

    With a ``pool``, buffers of at least :data:`POOLED_BYTES` are views lent by it (give them back
    once handled); the others are new ``bytearray`` s.
    """
    meta_len, n_bufs, flags = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if flags:
        raise ProtocolError(f"frame flags {flags:#x}: only the orchestrator reads shared buffers")
    lens = [_LEN.unpack(_recv_exact(sock, 8))[0] for _ in range(n_bufs)]
    _check_sizes(meta_len, lens)
    meta = _recv_exact(sock, meta_len)
    return meta, [_recv_exact(sock, n, pool) for n in lens]


# ---------------------------------------------------------------------- asyncio side

STAGING_BYTES = 256 << 10
"""Size of the staging buffer; a frame part larger than half of it is received in place."""

MAX_BUFS = 1 << 12
"""Most raw buffers one frame may carry (a frame announcing more is malformed)."""

Frame = tuple[bytearray, list[RecvBuffer]]

RECEIVE_POOL = BufferPool(keep=2)
"""Where :class:`FrameStream` receives buffers of :data:`POOLED_BYTES` or more (a slot state, a token's
full attention rows from the worker): memory already mapped and page-aligned (:mod:`contract.buffers`),
instead of a fresh ``bytearray`` zero-filled page by page before the bytes are copied over it.  Each is
recycled: lent again once no view of it is left (a token's rows once the client's transport wrote them),
with or without ``RECEIVE_POOL.give``."""


class Lender(Protocol):
    """Where a stream's :data:`FLAG_SHARED` buffers come from (:class:`contract.shm.RegionLender`)."""

    def lend(self, spans: Sequence[tuple[int, int]]) -> Sequence[memoryview]:
        """A view of each ``(offset, length)``; ValueError when one is outside the region."""
        ...


class FrameStream(asyncio.BufferedProtocol):
    """Both directions of one worker connection.

    ``await read_frame()`` returns ``(meta, buffers)`` in arrival order (``meta`` is the
    encoded message, each buffer a ``bytearray`` of exactly its announced length, or for
    :data:`POOLED_BYTES` or more a view lent by :data:`RECEIVE_POOL`; in a :data:`FLAG_SHARED` frame, views
    lent by ``region``, :mod:`contract.shm`) and raises
    :class:`ProtocolError` once the peer has closed the stream or sent a malformed frame (the
    transport is then closed).  ``write(chunks)`` + ``await drain()`` send, with the
    transport's flow control.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._staging = bytearray(STAGING_BYTES)
        self._view = memoryview(self._staging)
        self._have = 0  # bytes in the staging buffer not yet parsed
        self._parts: list[bytearray | memoryview] = []  # the current frame's meta and buffers, being filled
        self._filled = 0  # bytes in self._parts[self._part]
        self._part = -1  # which part is being filled (-1: waiting for a frame header)
        self._direct: memoryview | None = None  # the part received in place
        self._shared: list[RecvBuffer] = []  # the current frame's buffers lent from the shared region
        self.region: Lender | None = None  # set by whoever shares a region with the peer (contract.shm)
        self._frames: collections.deque[Frame] = collections.deque()
        self._error: ProtocolError | None = None
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    # ------------------------------------------------------------------ asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ProtocolError(f"peer closed the stream{f': {exc}' if exc else ''}"))

    def eof_received(self) -> bool:
        self._fail(ProtocolError("peer closed the stream"))
        return False

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._filled :]
        return self._view[self._have :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct is not None:
            self._filled += nbytes
            if self._filled == len(self._direct):
                self._direct = None
                self._next_part()
            return
        self._have += nbytes
        try:
            self._parse()
        except ProtocolError as exc:
            self._fail(exc)
            if self.transport is not None:
                self.transport.close()

    # ------------------------------------------------------------------ parsing

    def _parse(self) -> None:
        """Consume the staging buffer: headers, small parts, and the start of a large part."""
        pos = 0
        while pos < self._have and self._direct is None:
            if self._part < 0:
                if self._have - pos < _HEAD.size:
                    break
                meta_len, n_bufs, flags = _HEAD.unpack_from(self._staging, pos)
                if n_bufs > MAX_BUFS:
                    raise ProtocolError(f"frame announces {n_bufs} buffers (at most {MAX_BUFS})")
                if flags & ~FLAG_SHARED or (flags and self.region is None):
                    raise ProtocolError(f"frame flags {flags:#x} on a stream without a shared region")
                n_words = n_bufs * (2 if flags else 1)
                head = _HEAD.size + _LEN.size * n_words
                if self._have - pos < head:
                    break
                words = [_LEN.unpack_from(self._staging, pos + _HEAD.size + _LEN.size * i)[0] for i in range(n_words)]
                pos += head
                if flags:
                    _check_sizes(meta_len, ())
                    self._parts = [bytearray(meta_len)]
                    self._shared = self._lend(list(zip(words[::2], words[1::2], strict=True)))
                else:
                    _check_sizes(meta_len, words)
                    self._parts = [bytearray(meta_len), *(_receive_buffer(n) for n in words)]
                self._part, self._filled = 0, 0
                self._skip_empty()
                continue
            part = self._parts[self._part]
            take = min(len(part) - self._filled, self._have - pos)
            part[self._filled : self._filled + take] = self._view[pos : pos + take]
            self._filled += take
            pos += take
            if self._filled == len(part):
                self._next_part()
            elif len(part) - self._filled > STAGING_BYTES // 2:
                self._direct = memoryview(part)  # the rest arrives in place
        if pos:
            rest = bytes(self._view[pos : self._have])  # at most the staging size; never overlapping
            self._staging[: len(rest)] = rest
            self._have = len(rest)

    def _next_part(self) -> None:
        self._part += 1
        self._filled = 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._part < len(self._parts) and not self._parts[self._part]:
            self._part += 1
        if self._part == len(self._parts):
            meta, *bufs = self._parts
            assert isinstance(meta, bytearray)  # the meta part is always received into a bytearray
            self._frames.append((meta, bufs + self._shared))
            self._shared = []
            self._readable.set()
            self._parts, self._part = [], -1

    def _lend(self, spans: list[tuple[int, int]]) -> list[RecvBuffer]:
        assert self.region is not None
        try:
            return list(self.region.lend(spans))
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc

    def _fail(self, exc: ProtocolError) -> None:
        if self._error is None:
            self._error = exc
        self._readable.set()
        self._writable.set()

    # ------------------------------------------------------------------ the caller's side

    async def read_frame(self) -> Frame:
        """The next frame ``(meta, buffers)``; ProtocolError once the stream is closed or malformed."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._readable.clear()
            await self._readable.wait()
        return self._frames.popleft()

    def write(self, chunks: Sequence[Buffer]) -> None:
        """Queue byte chunks for sending (a gathered write); ProtocolError once the stream is closed."""
        if self._error is not None or self.transport is None or self.transport.is_closing():
            raise ProtocolError("the stream is closed")
        self.transport.writelines(chunks)  # type: ignore[arg-type]

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark."""
        await self._writable.wait()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Close the transport (idempotent)."""
        if self.transport is not None:
            self.transport.close()


def _receive_buffer(n: int) -> bytearray | memoryview:
    return RECEIVE_POOL.take(n, recycle=True) if n >= POOLED_BYTES else bytearray(n)


async def open_frame_stream(family: socket.AddressFamily, addr: str | tuple[str, int]) -> FrameStream:
    """Connect to a worker listening at ``addr`` (see :func:`contract.framing.parse_address`)."""
    loop = asyncio.get_running_loop()
    if family == socket.AF_UNIX:
        _, stream = await loop.create_unix_connection(FrameStream, addr)  # type: ignore[arg-type]
    else:
        assert isinstance(addr, tuple)
        host, port = addr
        _, stream = await loop.create_connection(FrameStream, host, port)
    return stream
