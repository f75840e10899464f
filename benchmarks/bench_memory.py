"""Memory of slotserve beside llama-server holding the same conversations, in one run: PSS of each process tree.

slotserve ``--parallel 4 --ctx-size 4096`` (embedded store, its default durability and ``--spare``)
and llama-server ``-np 4 -c 16384`` (four slots of 4,096 tokens: the same KV window per
conversation) run one after the other on the same model.  Each is measured at idle after start,
then with four conversations of ``--tokens`` tokens resident, each in its own slot
(``POST /completion`` with ``id_slot`` 0..3, ``n_predict`` 1, greedy: llama-server's API, which
slotserve serves too), right after the last one was answered (slotserve: and stored) and again after
``--idle-s`` seconds without requests (what a server gives back when idle).

The figure is PSS (proportional set size, ``psutil.Process.memory_full_info().pss``: Linux
``/proc/PID/smaps_rollup``), summed over the server's process and all its descendants (slotserve:
the orchestrator and its engine worker): a page shared by several processes (the model file mapped
by both, say) counts once in total, divided among them.  Printed per process and summed, with the
ratio slotserve / llama-server for each point.  One run: memory does not vary like speed does, but
the load average is printed with it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_memory.py --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import common
import httpx
import psutil
from common import load, machine
from servers import ServerProc, check, default_model, free_port, llama_server_cmd, settle, slotserve_cmd, stop_servers

MB = 1e6


def tree_pss(pid: int) -> dict[str, float]:
    """PSS in bytes of ``pid`` and each of its descendants, by ``name[pid]``."""
    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            out[f"{p.name()}[{p.pid}]"] = float(p.memory_full_info().pss)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


def show(name: str, point: str, pss: dict[str, float]) -> float:
    total = sum(pss.values())
    parts = ", ".join(f"{k} {v / MB:.1f}" for k, v in pss.items())
    print(f"  {name} {point}: PSS {total / MB:.1f} MB ({parts}); {load()}", flush=True)
    return total


def hold_conversations(client: httpx.Client, srv: ServerProc, prompts: list[list[int]]) -> None:
    """One conversation per slot: ``prompts[i]`` prefilled into slot ``i`` and one token generated."""
    for i, ids in enumerate(prompts):
        body = {"prompt": ids, "n_predict": 1, "temperature": 0, "id_slot": i, "cache_prompt": True}
        out = check(client.post(srv.base + "/completion", json=body), f"{srv.name} /completion slot {i}")
        print(f"  {srv.name} slot {i}: {out.get('tokens_evaluated', '?')} prompt tokens", flush=True)


def measure(
    client: httpx.Client, srv: ServerProc, prompts: list[list[int]], args: argparse.Namespace, slotserve: bool
) -> dict[str, float]:
    """Wait for ``srv`` (started), measure it idle, fill its four slots, measure at once and after ``--idle-s``."""
    if not slotserve:  # slotserve was waited for before its tokenizer was used
        print(f"{srv.name} ready on :{srv.port} in {srv.wait_ready(httpx):.1f}s", flush=True)
    time.sleep(args.start_s)
    got = {"idle after start": show(srv.name, "idle after start", tree_pss(srv.proc.pid))}
    hold_conversations(client, srv, prompts)
    if slotserve:
        settle(client, srv.base)
        listed = check(client.get(srv.base + "/slots"), "slots")
        held = {str(s["id"]): s.get("n_tokens", s.get("n_ctx_used")) for s in listed}
        print(f"  {srv.name} slots: {held}", flush=True)
    got["4 conversations, at once"] = show(srv.name, "4 conversations, at once", tree_pss(srv.proc.pid))
    time.sleep(args.idle_s)
    point = f"4 conversations, after {args.idle_s:g} s idle"
    got[point] = show(srv.name, point, tree_pss(srv.proc.pid))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (slotserve alone without)")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments, e.g. --llama-args=--no-repack")
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the server's default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=4096, help="tokens per slot (llama-server: -c 4 x this)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens of each of the four conversations")
    ap.add_argument("--spare", type=int, default=None, help="slotserve --spare (default: the server's default)")
    ap.add_argument("--start-s", type=float, default=3.0, help="seconds after ready before the idle figure")
    ap.add_argument("--idle-s", type=float, default=15.0, help="seconds idle before the last figure")
    ap.add_argument("--keep-logs", action="store_true")
    args = ap.parse_args()
    model = args.model or default_model()
    n_par = 4
    print(f"machine: {machine()}; model {model.name}; {load()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    servers: list[ServerProc] = []
    client = httpx.Client(timeout=None)
    results: dict[str, dict[str, float]] = {}
    try:
        port = free_port()
        cmd = slotserve_cmd(
            port, tmp / "state", parallel=n_par, spare=args.spare, ctx_size=args.ctx_size, threads=args.threads,
            model=model,
        )  # fmt: skip
        ss = ServerProc("slotserve", cmd, port, tmp / "slotserve.log")
        servers.append(ss)
        print(f"slotserve ready on :{port} in {ss.wait_ready(httpx):.1f}s", flush=True)
        tok = common.http_tokenizer(client, ss.base)
        prompts = [common.build_prompt(tok, args.tokens, variant=i + 1) for i in range(n_par)]
        results["slotserve"] = measure(client, ss, prompts, args, slotserve=True)
        stop_servers(servers, tmp, keep_logs=True)
        servers = []
        if args.llama_server:
            lport = free_port()
            lcmd = llama_server_cmd(
                args.llama_server, model, lport, parallel=n_par, ctx_size=args.ctx_size, threads=args.threads,
                n_gpu_layers=0, slot_dir=tmp / "llama-slots", extra=args.llama_args,
            )  # fmt: skip
            ls = ServerProc("llama-server", lcmd, lport, tmp / "llama-server.log")
            servers.append(ls)
            results["llama-server"] = measure(client, ls, prompts, args, slotserve=False)
    finally:
        stop_servers(servers, tmp, args.keep_logs)
    spare = "server default" if args.spare is None else str(args.spare)
    print()
    print(f"slotserve --parallel {n_par} --ctx-size {args.ctx_size} --spare ({spare}) --threads {args.threads}")
    if args.llama_server:
        flags = f"-np {n_par} -c {n_par * args.ctx_size} -t {args.threads} {args.llama_args}".rstrip()
        print(f"llama-server {args.llama_server} {flags}")
    print(f"four conversations of {args.tokens} tokens; at the end: {load()}")
    print(f"{'point':<36} | {'slotserve MB':>12} | {'llama-server MB':>15} | ratio")
    for point, mine in results["slotserve"].items():
        theirs = results.get("llama-server", {}).get(point)
        other = f"{theirs / MB:15.1f}" if theirs else f"{'-':>15}"
        ratio = f"{mine / theirs:.2f}" if theirs else "-"
        print(f"{point:<36} | {mine / MB:12.1f} | {other} | {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
