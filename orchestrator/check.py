"""``slotserve check``: does the engine work on this machine, in the configuration ``serve`` would use?

Starts the engine worker exactly as ``serve`` does (same options, same start-up retry),
then checks, one printed line each:

1. start-up: the worker reached ``Ready`` (its own self-check decodes and verifies the
   attention capture); the configuration in force (devices, offloaded layers, CPU weight
   repacking, flash attention, KV types);
2. a short greedy generation with full per-layer attention: every row is finite and
   sums to 1 over the context (on a model with attention sinks, ``ModelFacts.attention_sinks``, to more
   than 0 and at most 1: the sink takes the rest);
3. recomputation: each generated token's attention is computed again by a fresh
   prefill of the prompt plus the tokens before it (a new sequence, nothing cached) and
   compared per head with the streamed rows, and the fresh prefill must choose the same
   token (or a near-tie: see :data:`NEAR_TIE_NATS`);
4. reductions: the same generation again with ``attention_format`` ``topk`` (k :data:`TOP_K`) and
   ``aggregated``, which the graph computes itself (on a GPU with ggml's own operators): each token's
   weights must be the per-layer rows' k largest and the positions must hold them, the mean the rows' mean
   (within :data:`MAX_REDUCED_DIFF`).

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from contract import protocol as proto
from contract.model_facts import attention_rows_sum_ok
from contract.options import CaptureOptions, SamplingParams
from orchestrator.engine_client.client import WorkerClient
from orchestrator.engine_client.interface import EngineClient, EngineRequestError, GenerationJob, TokenOutput
from orchestrator.engine_client.launch import WorkerOptions

PROMPT = "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n"
N_TOKENS = 8
# Tolerances of the recomputation (same engine, other KV cells and batch shapes: llama.cpp
# quantizes activations per batch, so deep layers drift a little; see docs/hardware.md).
MIN_HEAD_CORRELATION = 0.98
MAX_MEAN_ABS_DIFF = 0.01
NEAR_TIE_NATS = 0.6  # a fresh prefill may pick another top token this close to the first one's logprob
TOP_K = 8
MAX_REDUCED_DIFF = 1e-3  # the same decodes computed again: only the graph's reduction order may differ


@dataclass
class Generated:
    """One generated token: id, its logprob, the top-5 ``(id, logprob)``, attention ``float32[L, H, n_ctx]`` (or
    the format asked), and for ``topk`` the ``int32`` positions of its weights."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    attention: np.ndarray
    positions: np.ndarray | None = None


async def generate(
    engine: EngineClient, seq: int, ids: list[int], n: int, capture: CaptureOptions | None = None
) -> list[Generated]:
    """Greedy ``n`` tokens on engine sequence ``seq`` from ``ids`` (erased first), with ``capture``'s attention
    (default: full per-layer float32); ``positions`` set for ``topk``."""
    await engine.erase(seq)
    params = SamplingParams(max_new_tokens=n, temperature=0.0, n_probs=5, logprobs=True, ignore_eos=True)
    capture = capture or CaptureOptions(attention=True, format="per_layer", dtype="float32")
    out: list[Generated] = []
    async for ev in await engine.generate(GenerationJob(seq=seq, input_ids=ids, params=params, capture=capture)):
        if isinstance(ev, TokenOutput) and (shape := ev.token.attention) is not None:
            t = ev.token
            att = np.frombuffer(ev.attention or b"", dtype=shape.dtype).reshape(shape.shape)
            pos = None
            if (pshape := t.attention_pos) is not None:
                pos = np.frombuffer(ev.positions or b"", dtype=pshape.dtype).reshape(pshape.shape)
            out.append(Generated(t.token_id, t.logprob or 0.0, list(t.top), att.astype(np.float32), pos))
    return out


class HeadStats(NamedTuple):
    """How two ``[L, H, n]`` attention tensors differ: ``corr`` the minimum over heads of the Pearson correlation
    of their rows, ``mad`` the mean absolute difference over everything, ``worst`` the ``(layer, head)`` of that
    minimum and ``worst_max`` the largest absolute difference in that head's row (a head whose row is nearly
    flat can lose correlation to rounding alone; this says where to look)."""

    corr: float
    mad: float
    worst: tuple[int, int]
    worst_max: float


def _head_stats(a: np.ndarray, b: np.ndarray) -> HeadStats:
    """:class:`HeadStats` of two ``[L, H, n]`` float attention tensors of one shape."""
    x = a.reshape(-1, a.shape[-1]).astype(np.float64)
    y = b.reshape(-1, b.shape[-1]).astype(np.float64)
    xc, yc = x - x.mean(axis=1, keepdims=True), y - y.mean(axis=1, keepdims=True)
    denom = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    corr = np.where(denom > 0, (xc * yc).sum(axis=1) / np.where(denom > 0, denom, 1), 1.0)
    i = int(corr.argmin())
    layer, head = divmod(i, a.shape[1])
    return HeadStats(float(corr[i]), float(np.abs(x - y).mean()), (layer, head), float(np.abs(x[i] - y[i]).max()))


class Report:
    """Prints one line per check and remembers whether any failed."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.failed = 0

    def line(self, ok: bool, name: str, detail: str) -> None:
        self.failed += not ok
        mark = "[green]ok  [/]" if ok else "[red]FAIL[/]"
        self.console.print(f"{mark} {name:<22} {detail}", highlight=False, soft_wrap=True)


async def _start(engine: WorkerClient, console: Console) -> proto.ModelInfo:
    """Start the worker with a progress bar over the model load."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  console=console, transient=True) as bar:  # fmt: skip
        task = bar.add_task("starting engine", total=1.0)
        start = asyncio.create_task(engine.start())
        while not start.done():
            bar.update(task, completed=engine.load_fraction, description=f"engine: {engine.stage}")
            await asyncio.wait([start], timeout=0.1)
        return start.result()


async def run_check(options: WorkerOptions, console: Console) -> int:
    """Run the checks (module docstring) and print a verdict; returns the exit status."""
    report = Report(console)
    engine = WorkerClient(options, restart=False)
    t0 = time.perf_counter()
    try:
        info = await _start(engine, console)
    except Exception as exc:
        report.line(False, "start-up", f"{type(exc).__name__}: {exc} (stage {engine.stage})")
        console.print("[red]verdict: FAIL[/] (the engine does not start on this machine)")
        return 1
    try:
        rt = info.runtime
        report.line(
            True, "start-up", f"{info.model_name}, {time.perf_counter() - t0:.1f} s, self-check {rt.self_check_ms} ms"
        )
        report.line(True, "devices", "; ".join(rt.devices))
        report.line(
            True,
            "configuration",
            f"backend {rt.backend}, {rt.n_layers_offloaded}/{info.num_layers} layers offloaded, "
            f"repack {'on' if rt.use_extra_bufts else 'off'} ({rt.repack_reason}), extra bufts {rt.extra_bufts}, "
            f"capture {rt.capture}, flash attention {'on' if rt.flash_attn else 'off'} ({rt.flash_attn_reason}), "
            f"KV {rt.type_k}/{rt.type_v}, {rt.n_threads} threads",
        )
        if info.attention_layers:
            await _check_attention(engine, report, fresh_seq=min(1, info.n_slots - 1), sinks=info.attention_sinks)
        else:
            report.line(True, "attention", f"none to check: a {info.memory.type} model has no attention layers")
    except (EngineRequestError, OSError, RuntimeError) as exc:
        report.line(False, "engine", f"{type(exc).__name__}: {exc}")
    finally:
        await engine.close()
    verdict = "[green]verdict: PASS[/]" if not report.failed else f"[red]verdict: FAIL[/] ({report.failed} checks)"
    console.print(verdict)
    return 0 if not report.failed else 1


async def _check_attention(engine: EngineClient, report: Report, fresh_seq: int, sinks: bool = False) -> None:
    prompt = (await engine.tokenize(PROMPT, True, True)).ids
    t0 = time.perf_counter()
    gen = await generate(engine, 0, prompt, N_TOKENS)
    ms = (time.perf_counter() - t0) * 1000
    sums = [g.attention.sum(axis=-1) for g in gen]
    finite = all(np.isfinite(g.attention).all() for g in gen)
    sums_ok = all(attention_rows_sum_ok(s, sinks) for s in sums)
    text = "".join(engine.pieces[g.token].decode("utf-8", "replace") for g in gen)
    report.line(
        len(gen) == N_TOKENS and finite and sums_ok,
        "greedy generation",
        f"{len(gen)} tokens in {ms:.0f} ms {text!r}; rows finite {finite}, "
        f"sum to {'at most ' if sinks else ''}1 {sums_ok}",
    )
    worst, worst_mad, tokens_ok = HeadStats(1.0, 0.0, (0, 0), 0.0), 0.0, True
    for k, g in enumerate(gen):
        fresh = (await generate(engine, fresh_seq, prompt + [x.token for x in gen[:k]], 1))[0]
        stats = _head_stats(g.attention, fresh.attention)
        worst = min(worst, stats, key=lambda s: s.corr)
        worst_mad = max(worst_mad, stats.mad)
        if fresh.token != g.token:
            near = dict(g.top).get(fresh.token)
            tokens_ok &= near is not None and g.logprob - near <= NEAR_TIE_NATS
            break  # the continuations part here: later tokens have other contexts
    await engine.erase(fresh_seq)
    report.line(tokens_ok, "recomputed tokens", "fresh prefills choose the generated tokens" if tokens_ok else
                "a fresh prefill chose another token, not a near-tie")  # fmt: skip
    report.line(
        worst.corr >= MIN_HEAD_CORRELATION and worst_mad <= MAX_MEAN_ABS_DIFF,
        "recomputed attention",
        f"min per-head correlation {worst.corr:.4f} (>= {MIN_HEAD_CORRELATION}; layer {worst.worst[0]} head "
        f"{worst.worst[1]}, largest abs diff there {worst.worst_max:.5f}), "
        f"worst mean abs diff {worst_mad:.5f} (<= {MAX_MEAN_ABS_DIFF})",
    )
    await _check_reductions(engine, report, prompt, gen)
    await engine.erase(0)


async def _check_reductions(engine: EngineClient, report: Report, prompt: list[int], gen: list[Generated]) -> None:
    """Check 4 (module docstring): ``gen``'s generation of ``prompt`` on sequence 0 again in ``topk`` and in
    ``aggregated``, each token against ``gen``'s per-layer rows."""
    cap = CaptureOptions(attention=True, format="topk", top_k=TOP_K)
    top = await generate(engine, 0, prompt, len(gen), cap)
    mean = await generate(engine, 0, prompt, len(gen), CaptureOptions(attention=True, format="aggregated"))
    same = [g.token for g in top] == [g.token for g in mean] == [g.token for g in gen]
    top_diff = mean_diff = float("inf")
    if same:
        top_diff = max(_top_k_diff(full, t) for full, t in zip(gen, top, strict=True))
        mean_diff = max(
            float(np.abs(m.attention - full.attention.mean(axis=(0, 1))).max())
            for full, m in zip(gen, mean, strict=True)
        )
    report.line(
        same and max(top_diff, mean_diff) <= MAX_REDUCED_DIFF,
        "reduced attention",
        f"the same tokens {same}; topk (k {TOP_K}) against the rows' largest: largest diff {top_diff:.2g}, "
        f"aggregated against their mean: {mean_diff:.2g} (<= {MAX_REDUCED_DIFF})",
    )


def _top_k_diff(full: Generated, top: Generated) -> float:
    """The largest difference between ``top``'s ``topk`` weights and ``full``'s rows' k largest (best first), or
    between those and the weights of ``full``'s rows at ``top``'s positions; inf for a wrong shape."""
    if top.positions is None or top.attention.shape != (*full.attention.shape[:2], TOP_K):
        return float("inf")
    want = -np.sort(-full.attention, axis=-1)[..., :TOP_K]
    held = np.take_along_axis(full.attention, top.positions.astype(np.int64), axis=-1)
    return max(float(np.abs(top.attention - want).max()), float(np.abs(held - want).max()))


def main(options: WorkerOptions) -> int:
    """Entry of ``slotserve check``."""
    return asyncio.run(run_check(options, Console(file=sys.stdout)))
