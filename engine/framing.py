"""Frames on the worker's stream, and worker addresses.

A frame is one msgpack-encoded message (:mod:`engine.protocol`) followed by the raw byte
buffers it describes (little-endian)::

    u32 meta_len | u16 n_bufs | u16 flags(0) | u64 buf_len[n_bufs] | meta (msgpack) | buf_0 ... buf_{n-1}

Buffers are written with a gathered ``sendmsg`` (never copied, never base64, never
pickled).  A message describes each of its buffers with a :class:`Tensor` (index,
dtype, shape).  This module knows nothing of the messages themselves; it moves bytes.
"""

from __future__ import annotations

import asyncio
import math
import socket
import struct
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

_HEAD = struct.Struct("<IHH")
_LEN = struct.Struct("<Q")
MAX_META_BYTES = 64 << 20
MAX_BUF_BYTES = 8 << 30

Buffer = bytes | bytearray | memoryview
"""A raw buffer: anything exposing the buffer protocol as bytes."""


class ProtocolError(RuntimeError):
    """The peer sent a malformed frame or message, or closed the stream mid-frame."""


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


Dtype = Literal["float32", "float16", "uint8"]
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "uint8": 1}


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


def send_chunks(sock: socket.socket, chunks: Sequence[Buffer]) -> None:
    """Write byte chunks to a blocking socket (gathered write; a partial write goes on without copying)."""
    views = [memoryview(c).cast("B") for c in chunks]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if views:
            views[0] = views[0][sent:]


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
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


def recv_frame(sock: socket.socket) -> tuple[bytearray, list[bytearray]]:
    """Read one frame from a blocking socket: ``(meta, buffers)``; ProtocolError when malformed or cut."""
    meta_len, n_bufs, _ = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    lens = [_LEN.unpack(_recv_exact(sock, 8))[0] for _ in range(n_bufs)]
    _check_sizes(meta_len, lens)
    meta = _recv_exact(sock, meta_len)
    return meta, [_recv_exact(sock, n) for n in lens]


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, list[bytes]]:
    """Read one frame from an ``asyncio.StreamReader``: ``(meta, buffers)``.

    Raises ProtocolError for an oversized frame and ``asyncio.IncompleteReadError`` when
    the stream ends mid-frame.
    """
    meta_len, n_bufs, _ = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    lens = [_LEN.unpack(await reader.readexactly(8))[0] for _ in range(n_bufs)]
    _check_sizes(meta_len, lens)
    meta = await reader.readexactly(meta_len)
    return meta, [await reader.readexactly(n) for n in lens]
