"""Build a redis-py asyncio client from a URL (plain, TLS, unix socket, Sentinel, Cluster).

Accepted forms:

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS), ``unix:///path.sock[?db=N]``:
  passed to ``redis.asyncio.Redis.from_url`` (its query parameters work, e.g. ``?ssl_cert_reqs=none``).
- ``redis+sentinel://[[user]:password@]host:port[,host2:port2...]/service_name[/db]`` (also
  ``rediss+sentinel://`` for TLS to the master): the master of ``service_name`` via
  ``redis.asyncio.sentinel.Sentinel``. Sentinel port defaults to 26379. The credentials are for the
  master; query parameters ``sentinel_username`` / ``sentinel_password`` authenticate to the sentinels.
- ``redis+cluster://[[user]:password@]host:port[,host2:port2...]`` (also ``rediss+cluster://``):
  ``redis.asyncio.cluster.RedisCluster``. Port defaults to 6379.

All clients use binary values (``decode_responses=False``), the given socket timeouts (seconds) and a
short retry policy, so an outage surfaces as an error within about ``socket_timeout`` instead of hanging.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff

from storage.errors import StoreUnavailableError

__all__ = ["UNAVAILABLE", "Connection", "RedisClient", "connect", "glob_escape", "parse_hosts", "unavailable"]

RedisClient = Redis | RedisCluster

UNAVAILABLE: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,  # includes BusyLoadingError (AOF loading), MasterNotFoundError, auth errors
    rexc.TimeoutError,
    rexc.ClusterDownError,
    rexc.TryAgainError,
    rexc.RedisClusterException,
    rexc.ReadOnlyError,  # failover in progress: we talk to a demoted master
    rexc.OutOfMemoryError,
    TimeoutError,
    OSError,
)
"""The redis-py and socket errors that mean "cannot reach Redis now" (:func:`unavailable`)."""


@asynccontextmanager
async def unavailable(what: str) -> AsyncIterator[None]:
    """Turn redis-py's connection and timeout errors (:data:`UNAVAILABLE`) inside the block into
    :class:`storage.errors.StoreUnavailableError`."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise StoreUnavailableError(f"redis unavailable during {what}: {exc!r}") from exc


def glob_escape(raw: bytes) -> bytes:
    """``raw`` with the glob characters of ``SCAN ... MATCH`` (``*?[]\\``) backslash-escaped."""
    out = bytearray()
    for b in raw:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)


@dataclass
class Connection:
    """A connected client plus what must be closed with it (e.g. the sentinel clients)."""

    client: RedisClient
    kind: str  # "redis", "sentinel" or "cluster"
    closers: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)

    async def aclose(self) -> None:
        """Close the client and its helpers."""
        await self.client.aclose()
        for close in self.closers:
            await close()


def parse_hosts(hostlist: str, default_port: int) -> list[tuple[str, int]]:
    """Parse ``"h1:p1,h2,[::1]:p3"`` into ``[(host, port), ...]``.

    Raises:
        ValueError: empty list or a malformed entry.
    """
    out = []
    for item in hostlist.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_s = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_s = item.rpartition(":") if ":" in item else (item, "", "")
        if not host:
            raise ValueError(f"bad host entry {item!r}")
        try:
            out.append((unquote(host), int(port_s) if port_s else default_port))
        except ValueError:
            raise ValueError(f"bad port in {item!r}") from None
    if not out:
        raise ValueError("no hosts in URL")
    return out


def _split_netloc(netloc: str) -> tuple[str | None, str | None, str]:
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None), hosts


def connect(
    url: str,
    *,
    socket_timeout: float = 5.0,
    connect_timeout: float = 2.0,
    retries: int = 2,
    **client_kwargs: Any,
) -> Connection:
    """Create (lazily connecting) a client for ``url``; see the module docstring for URL forms.

    Args:
        socket_timeout: seconds to wait for a reply before raising a timeout.
        connect_timeout: seconds to wait for a TCP/unix connect.
        retries: retries of a command after a connection error/timeout (with 10-250 ms backoff).
        client_kwargs: extra keyword arguments for the redis-py client.

    Raises:
        ValueError: unsupported scheme or malformed URL.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    common: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.25), retries),
        **client_kwargs,
    }
    if scheme in ("redis", "rediss", "unix"):
        return Connection(Redis.from_url(url, **common), "redis")

    base, plus, mode = scheme.partition("+")
    if not plus or base not in ("redis", "rediss") or mode not in ("sentinel", "cluster"):
        raise ValueError(f"unsupported store URL scheme {parts.scheme!r}")
    user, password, hostlist = _split_netloc(parts.netloc)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    auth: dict[str, Any] = {"username": user, "password": password}
    tls: dict[str, Any] = {"ssl": True} if base == "rediss" else {}

    if mode == "cluster":
        hosts = parse_hosts(hostlist, 6379)
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError("Redis Cluster has no databases other than 0")
        nodes = [ClusterNode(h, p) for h, p in hosts]
        client = RedisCluster(startup_nodes=nodes, **auth, **tls, **common)
        return Connection(client, "cluster")

    hosts = parse_hosts(hostlist, 26379)
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("sentinel URL needs /service_name[/db]")
    service = path[0]
    db = int(path[1]) if len(path) == 2 else 0
    sentinel_kwargs = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "username": query.get("sentinel_username"),
        "password": query.get("sentinel_password"),
    }
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, db=db, **auth, **tls, **common)
    client = sentinel.master_for(service)
    return Connection(client, "sentinel", [s.aclose for s in sentinel.sentinels])
