"""Run a real, throw-away ``redis-server`` for tests (never touches the system instance).

``RedisServer(data_dir)`` picks a free TCP port (and a unix socket in ``data_dir``), runs
``redis-server --port N --dir data_dir --save '' --appendonly yes`` and waits until it answers PING.
``stop()`` (SIGTERM: the AOF is flushed) and ``start()`` again reuse the same port and directory, so
tests can simulate an outage and check durability; ``pause()``/``resume()`` (SIGSTOP/SIGCONT) make it
hang instead, to test timeouts. ``RedisServer.cluster(...)`` starts a one-node Redis Cluster,
``RedisCluster3`` a cluster of three masters (hash slots split by ``redis-cli --cluster create``),
``RedisSentinel`` a sentinel watching a server and ``SentinelSetup`` a master, its replica and a
sentinel watching them.

``require_redis_server()`` skips the calling test (pytest.skip) when ``redis-server`` is not installed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, Self

import pytest

__all__ = [
    "RedisCluster3",
    "RedisSentinel",
    "RedisServer",
    "SentinelSetup",
    "free_port",
    "require_redis_server",
    "resp_command",
]


def require_redis_server() -> str:
    """Path of ``redis-server``; skips the test if it is not installed."""
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    return path


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster: bool = False) -> int:
    """A TCP port that was free a moment ago on 127.0.0.1.

    With ``cluster``, a port of at most 55535 whose cluster bus port (port + 10000) is free too.
    """
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randint(20000, 31999)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _read_reply(f: BinaryIO) -> object:
    line = f.readline()
    if not line:
        raise ConnectionError("connection closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read_reply(f) for _ in range(n)]
    raise RuntimeError(f"unexpected RESP reply {line!r}")


def resp_command(port: int, *args: str | bytes, timeout: float = 2.0) -> object:
    """Send one command to 127.0.0.1:``port`` over raw RESP; return the parsed reply.

    Raises RuntimeError on an error reply, OSError if the server does not answer.
    """
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    payload = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        with s.makefile("rb") as f:
            return _read_reply(f)


class RedisServer:
    """One ``redis-server`` process with its own port and data directory."""

    def __init__(self, data_dir: Path, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        self.executable = require_redis_server()
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.unix_socket = self.data_dir / "redis.sock"
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def cluster(cls, data_dir: Path) -> RedisServer:
        """A started one-node Redis Cluster owning all 16384 hash slots."""
        server = cls(
            data_dir,
            port=free_port(cluster=True),
            extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
        )
        server.start()
        resp_command(server.port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        server._wait(lambda: b"cluster_state:ok" in (resp_command(server.port, "CLUSTER", "INFO") or b""))
        return server

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        """``unix://<data_dir>/redis.sock``."""
        return f"unix://{self.unix_socket}"

    @property
    def running(self) -> bool:
        """True while the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
        return ""

    def _wait(self, ready: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if ready():
                    return
            except (OSError, RuntimeError):
                pass  # not listening yet, or -LOADING
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} not ready:\n{self._log_tail()}")
            time.sleep(0.02)

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart) on the same port and directory; returns once PING answers PONG."""
        if self.running:
            return
        args = [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.unix_socket),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", "redis.log",
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, cwd=self.data_dir, stdin=subprocess.DEVNULL)
        self._wait(lambda: resp_command(self.port, "PING", timeout=0.5) == b"PONG", timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Shut down with SIGTERM (AOF flushed) and wait; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # in case it was paused
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but never answered (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinel(RedisServer):
    """A ``redis-server --sentinel`` monitoring ``master_port`` as service ``service``."""

    def __init__(self, data_dir: Path, master_port: int, service: str = "mymaster") -> None:
        super().__init__(data_dir)
        self.service = service
        self.master_port = master_port

    def start(self, timeout: float = 10.0) -> None:
        """Write sentinel.conf (sentinel rewrites it) and start in sentinel mode."""
        if self.running:
            return
        conf = self.data_dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.data_dir}\nlogfile redis.log\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1\n"
        )
        self.proc = subprocess.Popen(
            [self.executable, str(conf), "--sentinel"], cwd=self.data_dir, stdin=subprocess.DEVNULL
        )
        self._wait(lambda: resp_command(self.port, "PING", timeout=0.5) == b"PONG", timeout)

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<port>/<service>/0``."""
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/0"


class RedisCluster3:
    """A Redis Cluster of three masters, no replicas, each a :class:`RedisServer` in its own directory
    under ``data_dir``; ``redis-cli --cluster create`` splits the 16384 hash slots between them."""

    def __init__(self, data_dir: Path, n_masters: int = 3) -> None:
        self.nodes = [
            RedisServer(
                Path(data_dir) / f"node{i}",
                port=free_port(cluster=True),
                extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
            )
            for i in range(n_masters)
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster, and wait until every node says ``cluster_state:ok``."""
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.skip("redis-cli is not installed (apt-get install -y redis-tools)")
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        for node in self.nodes:
            node._wait(
                lambda node=node: (
                    b"cluster_state:ok" in (resp_command(node.port, "CLUSTER", "INFO") or b"")  # type: ignore[misc]
                    and b"cluster_known_nodes:%d" % len(self.nodes)
                    in (resp_command(node.port, "CLUSTER", "INFO") or b"")
                ),
                timeout,
            )

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()


class SentinelSetup:
    """A master, one replica of it, and a sentinel monitoring the master as ``service``."""

    def __init__(self, data_dir: Path, service: str = "mymaster") -> None:
        self.master = RedisServer(Path(data_dir) / "master")
        self.replica = RedisServer(Path(data_dir) / "replica")
        self.service = service
        self.sentinel: RedisSentinel | None = None
        self.data_dir = Path(data_dir)

    @property
    def url(self) -> str:
        """``redis+sentinel://`` of the sentinel and the service."""
        assert self.sentinel is not None
        return self.sentinel.url

    def start(self, timeout: float = 30.0) -> None:
        """Start master and replica, wait until the replica is in sync, then start the sentinel and
        wait until it names the master."""
        self.master.start()
        self.replica.extra_args = ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.replica.start()
        self.replica._wait(
            lambda: b"master_link_status:up" in (resp_command(self.replica.port, "INFO", "replication") or b""),
            timeout,
        )
        self.sentinel = RedisSentinel(self.data_dir / "sentinel", self.master.port, self.service)
        self.sentinel.start()
        want = [b"127.0.0.1", str(self.master.port).encode()]
        sentinel = self.sentinel
        sentinel._wait(
            lambda: resp_command(sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service) == want,
            timeout,
        )

    def stop(self) -> None:
        """Stop the sentinel, the replica and the master."""
        for server in (self.sentinel, self.replica, self.master):
            if server is not None:
                server.stop()
