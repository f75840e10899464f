"""Slot-file restore (``POST /slots/{id}?action=restore``) of a ``--tokens``-token slot, slotserve beside
llama-server (built from the same llama.cpp), both with the same KV layout and each with its defaults.

The layout decides much of a restore's cost: with flash attention on, llama.cpp stores V by rows (a file's
V records are copied a row at a time), with it off V is transposed (each record is scattered over
``n_embd_v_gqa`` rows, one element per cell).  On a CPU slotserve's ``--flash-attn auto`` is off
(``engine/backend.py``) and llama-server's is on, so their default slot files differ; this script runs
slotserve ``--flash-attn auto`` and ``on`` beside llama-server ``-fa off`` and its default, each restoring a
file of its own layout (llama-server's files for slotserve ``on``, ``bench_table.py`` restores slotserve's).

Three cases per rep, interleaved, each restore timed by the client (``http.client``, as ``big_slot.py``):
``emptied``: slotserve restores a new slot right after erasing another (the sequence just emptied is the
lowest free one too); ``beside``: a sequence emptied ``--released-s`` seconds before (its KV stream given
back, ``engine/kv_release.py``) and another emptied just now are both free, and the restore should land in
the one emptied last; llama-server restores into its slot 1.  Prints each restore's landing sequence.

    .venv/bin/python benchmarks/bench_file_restore.py --llama-server /path/to/llama-server [--reps 6]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
from big_slot import RawClient
from common import load, median
from servers import ServerProc, default_model, free_port, llama_server_cmd, settle, slotserve_cmd, stop_servers

FILE = {"filename": "big.bin"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--released-s", type=float, default=6.5, help="> the worker's 5 s release delay")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    model = args.model or default_model()
    tmp = Path(tempfile.mkdtemp(prefix="bench-file-restore-"))
    ss_flags = {"slotserve": "auto", "slotserve fa on": "on"}
    ls_flags = {"llama-server -fa off": "-fa off", "llama-server": ""}
    servers: dict[str, ServerProc] = {}
    for name, fa in ss_flags.items():
        port, d = free_port(), tmp / f"{name}-slots".replace(" ", "-")
        d.mkdir()
        cmd = slotserve_cmd(
            port, d.with_suffix(".state"), parallel=4, spare=2, ctx_size=4096, threads=2, model=model,
            extra=["--slot-save-path", str(d), "--flash-attn", fa],
        )  # fmt: skip
        servers[name] = ServerProc(name, cmd, port, tmp / f"{d.name}.log")
    for name, extra in ls_flags.items():
        port, d = free_port(), tmp / f"{name}-slots".replace(" ", "-")
        cmd = llama_server_cmd(
            args.llama_server, model, port, parallel=4, ctx_size=4096, threads=2, n_gpu_layers=0, slot_dir=d,
            extra=extra,
        )  # fmt: skip
        servers[name] = ServerProc(name, cmd, port, tmp / f"{d.name}.log")
    client = httpx.Client(timeout=None)
    try:
        for srv in servers.values():
            srv.wait_ready(httpx)
        print(f"{load()}; preparing the slot files (three prefills of {args.tokens} tokens)", flush=True)
        ids = [(i * 7919) % 40000 + 100 for i in range(args.tokens)]
        for name in ("llama-server", "llama-server -fa off", "slotserve"):
            base = servers[name].base
            if name.startswith("llama"):
                body = {"prompt": ids, "n_predict": 1, "temperature": 0, "id_slot": 0, "cache_prompt": True}
                client.post(base + "/completion", json=body).raise_for_status()
                client.post(base + "/slots/0?action=save", json=FILE).raise_for_status()
            else:
                body = {"input_ids": ids, "max_new_tokens": 0, "temperature": 0, "id_slot": "big", "wait": True}
                client.post(base + "/api/v1/generate", json=body).raise_for_status()
                client.post(base + "/slots/big?action=save", json=FILE).raise_for_status()
        shutil.copy(tmp / "llama-server-slots" / "big.bin", tmp / "slotserve-fa-on-slots" / "big.bin")
        figures = run(args, servers, client)
    finally:
        stop_servers(servers.values(), tmp, args.keep_logs)
    print(f"\n{args.tokens}-token slot file, medians of {args.reps} reps (ms, client), at the end {load()}")
    pairs = [
        ("emptied: slotserve | llama-server -fa off (V transposed)", "slotserve emptied", "llama-server -fa off"),
        ("emptied: slotserve --flash-attn on | llama-server (V by rows)", "slotserve fa on emptied", "llama-server"),
        ("emptied: slotserve | llama-server, each its defaults", "slotserve emptied", "llama-server"),
        ("beside a given-back one: slotserve | llama-server, each its defaults", "slotserve beside", "llama-server"),
    ]
    for what, mine, ref in pairs:
        a, b = median(figures[mine]), median(figures[ref])
        print(f"{what}: {a:.1f} | {b:.1f} = {a / b:.2f}")
    return 0


def run(args: argparse.Namespace, servers: dict[str, ServerProc], client: httpx.Client) -> dict[str, list[float]]:
    """The interleaved reps (see the module docstring); client ms by case."""
    raw = {name: RawClient(srv.base) for name, srv in servers.items()}

    def restore(name: str, slot: str) -> float:
        t0 = time.perf_counter()
        raw[name].json(f"/slots/{slot}?action=restore", FILE, f"{name} restore")
        return (time.perf_counter() - t0) * 1000

    def erase(name: str, slot: str) -> None:
        client.post(f"{servers[name].base}/slots/{slot}", params={"action": "erase", "wait": "true"})

    def seq_of(name: str, slot: str) -> int | None:
        return next((s.get("seq") for s in client.get(servers[name].base + "/slots").json() if s["id"] == slot), None)

    for name in ("slotserve", "slotserve fa on"):
        if seq_of(name, "big") is None:
            restore(name, "big")  # the big slot holds a sequence in both
        restore(name, "warm")
        erase(name, "warm")
    for name in ("llama-server", "llama-server -fa off"):
        restore(name, "1")
    figures: dict[str, list[float]] = {}
    order = list(servers)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            if name.startswith("llama"):
                time.sleep(0.3)
                figures.setdefault(name, []).append(restore(name, "1"))
                continue
            restore(name, f"p{rep}")
            settle(client, servers[name].base)
            erase(name, f"p{rep}")
            time.sleep(0.3)
            ms = restore(name, f"e{rep}")
            figures.setdefault(f"{name} emptied", []).append(ms)
            print(f"  rep {rep} {name} emptied: {ms:.1f} ms in sequence {seq_of(name, f'e{rep}')}", flush=True)
            erase(name, f"e{rep}")
        # beside: the sequence emptied --released-s ago (given back) and the one emptied now
        for slot in (f"a{rep}", f"b{rep}"):
            restore("slotserve", slot)
        settle(client, servers["slotserve"].base)
        old, new = seq_of("slotserve", f"a{rep}"), seq_of("slotserve", f"b{rep}")
        erase("slotserve", f"a{rep}")
        time.sleep(args.released_s)
        erase("slotserve", f"b{rep}")
        time.sleep(0.3)
        ms = restore("slotserve", f"l{rep}")
        figures.setdefault("slotserve beside", []).append(ms)
        got = seq_of("slotserve", f"l{rep}")
        print(f"  rep {rep} beside: {ms:.1f} ms in sequence {got} (emptied {old} before, {new} now); {load()}")
        erase("slotserve", f"l{rep}")
    for c in raw.values():
        c.close()
    return figures


if __name__ == "__main__":
    sys.exit(main())
