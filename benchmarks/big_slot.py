"""``bench_table.py``'s rows for one big slot: prefill, save and restore through the API (octet-stream
bodies) and through slot files, beside llama-server's prefill and slot files, and the HTTP floor.

Big bodies are moved with ``http.client`` (the standard library's client, one kept connection): a
client's own cost is part of every API figure, and httpx's is several times the server's for tens of MB
(measured: ~160 ms to download 46 MB, vs ~35 ms with ``http.client``). The floor row moves the same
number of bytes through a server that does nothing else (``http_floor.py``: the same Litestar + uvicorn
stack), with the same client.  Both servers run with their default flags (flash attention ``auto``), so
on a CPU their slot files do not hold the same KV layout: slotserve's ``auto`` is off there
(``engine/backend.py``: V transposed, scattered one element per cell on a restore), llama-server's on (V by
rows).  ``bench_file_restore.py`` compares slot-file restores layout for layout.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from common import median
from servers import ServerProc, free_port, settle

OCTET = "application/octet-stream"


class RawClient:
    """``http.client`` to ``base``, a new connection per request (a kept one may have been closed by the
    server's keep-alive timeout while the benchmark waited): ``request`` returns ``(status, body bytes)``."""

    def __init__(self, base: str) -> None:
        u = urlsplit(base)
        self.host, self.port = u.hostname, u.port
        self.conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        self.close()
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)  # type: ignore[arg-type]
        self.conn.request(method, path, body=body, headers=headers or {})
        resp = self.conn.getresponse()
        return resp.status, resp.read()

    def json(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        status, data = self.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if status // 100 != 2:
            raise RuntimeError(f"{what}: HTTP {status} {data[:400]!r}")
        return json.loads(data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def start_floor(tmp: Path, httpx_mod: Any) -> ServerProc:
    """The HTTP floor server (``http_floor.py``), ready."""
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).with_name("http_floor.py")), "--port", str(port)]
    srv = ServerProc("http-floor", cmd, port, tmp / "http-floor.log")
    srv.wait_ready(httpx_mod)
    return srv


def big_slot(bench: Any, ctx: list[int]) -> None:
    """Prefill slot ``big`` with ``ctx``; its save/restore rows (see the module docstring)."""
    from bench_preview import generate_sample

    a, t, base = bench.args, bench.table, bench.ss.base
    bench.erase(base, ["0", "1", "2", "3"])
    if bench.ls:
        bench.erase(bench.ls.base, ["0", "1", "2", "3"])
    settle(bench.client, base)
    pf, d = bench.timed(lambda: generate_sample(bench.client, base, "big", ctx, 0), "prefill", once=True)
    if d.n_prefilled != len(ctx):
        raise RuntimeError(f"prefill: {d.n_prefilled} of {len(ctx)} tokens prefilled")
    lpf = float("nan")
    if bench.ls:
        lpf, d = bench.timed(lambda: bench.llama_complete(0, ctx), "llama-server prefill", once=True)
        print(f"  llama-server: prompt_n {d['timings']['prompt_n']}, prompt_ms {d['timings']['prompt_ms']:.1f}")
        if d["timings"]["prompt_n"] < len(ctx) - 1:
            raise RuntimeError(f"llama-server prefill: only {d['timings']['prompt_n']} tokens evaluated")
    ss, ls = RawClient(base), RawClient(bench.ls.base) if bench.ls else None
    floor = start_floor(bench.tmp, bench.httpx)
    fc = RawClient(floor.base)
    fig: dict[str, list[float]] = {}
    size = 0
    try:
        for r in range(a.reps + 1):
            settle(bench.client, base)
            blob = _expect(ss.request("POST", "/slots/big?action=save-state&wait=true", headers={"Accept": OCTET}))
            size = len(blob)
            steps = _steps(ss, ls, fc, blob, r)
            times = []
            for name, fn, after in steps:
                if after is None:
                    settle(bench.client, base)
                if name.endswith("save"):
                    os.sync()  # every save starts with no dirty pages to throttle it (left by the last rep's writes)
                times.append((name, bench.timed(fn, name, r == 0)[0]))
                if after:
                    bench.erase(base, [after])
            print(f"  rep {r}: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in times), flush=True)
            if r:
                for k, v in times:
                    fig.setdefault(k, []).append(v * 1000)
    finally:
        ss.close()
        fc.close()
        if ls is not None:
            ls.close()
        floor.stop()
    m = {k: median(v) for k, v in fig.items()}
    nan = float("nan")
    n = f"{a.big}-token slot ({size / 1e6:.1f} MB)"
    t.add(f"{n}: prefill ms", f"{pf * 1000:.0f}", f"{lpf * 1000:.0f}", f"{pf / lpf:.2f}")
    for op in ("save", "restore"):
        ref = m.get(f"llama {op}", nan)
        api, file = m[f"api {op}"], m[f"file {op}"]
        t.add(
            f"{n}: {op} ms through the API (octet-stream) | llama-server slot file",
            f"{api:.1f}",
            f"{ref:.1f}",
            f"{api / ref:.2f}",
        )
        t.add(
            f"{n}: {op} ms, slotserve slot file (?action={op}) | llama-server slot file",
            f"{file:.1f}",
            f"{ref:.1f}",
            f"{file / ref:.2f}",
        )
    t.add(
        f"{n}: restore through the API / prefill",
        f"{m['api restore'] / (pf * 1000):.4f}",
        f"{m.get('llama restore', nan) / (lpf * 1000):.4f}",
    )
    t.add(
        f"HTTP floor: {size / 1e6:.1f} MB down / up through Litestar + uvicorn alone, same client",
        f"{m['floor down']:.1f} / {m['floor up']:.1f} ms",
    )


def _expect(got: tuple[int, bytes]) -> bytes:
    status, data = got
    if status != 200:
        raise RuntimeError(f"HTTP {status} {data[:300]!r}")
    return data


Step = tuple[str, Any, "str | bool | None"]


def _steps(ss: RawClient, ls: RawClient | None, fc: RawClient, blob: bytes, r: int) -> list[Step]:
    """One rep's measured calls: ``(name, fn, after)``; ``after``: a slot to erase after the call, or
    ``None`` to let slotserve settle before it, or False for neither."""
    body = {"filename": "big.bin"}
    save = "/slots/big?action=save-state&wait=true"
    restore = f"/slots/big-{r}?action=restore-state&wait=true"
    steps: list[Step] = [
        ("api save", lambda: _expect(ss.request("POST", save, headers={"Accept": OCTET})), False),
        ("api restore", lambda: _expect(ss.request("POST", restore, blob, {"Content-Type": OCTET})), f"big-{r}"),
        ("file save", lambda: ss.json("/slots/big?action=save", body, "save"), None),
        ("file restore", lambda: ss.json(f"/slots/f-{r}?action=restore", body, "restore"), f"f-{r}"),
    ]  # fmt: skip
    if ls is not None:
        steps += [
            ("llama save", lambda: ls.json("/slots/0?action=save", body, "llama save"), False),
            ("llama restore", lambda: ls.json("/slots/1?action=restore", body, "llama restore"), False),
        ]
    steps.append(("floor down", lambda: fc.request("GET", f"/blob/{len(blob)}"), False))
    steps.append(("floor up", lambda: fc.request("POST", "/sink", blob, {"Content-Type": OCTET}), False))
    return steps
