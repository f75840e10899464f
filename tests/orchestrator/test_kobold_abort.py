"""KoboldAI Lite's Abort, as Lite does it: it closes its stream and posts ``/api/extra/abort``,
then the user sends the next turn at once.  The write-behind that follows each aborted turn must
never fail on the slot's next generation (issue 21, item 4), and ``/api/extra/perf`` counts the
aborted generations with KoboldCpp's ``stop_reason`` for them (``OUT_OF_TOKENS``, 0: KoboldCpp's
``gpttype_generate`` starts every generation with that reason and an abort keeps it)."""

from __future__ import annotations

import threading

import httpx

from tests.conftest import ServerProc
from tests.orchestrator.test_kobold_api import STORY, lite_body


def _abort_mid_stream(url: str, genkey: str, slot: str) -> None:
    body = lite_body(STORY * 3, genkey, max_length=300, stop_sequence=[], id_slot=slot)
    with httpx.stream("POST", url + "/api/extra/generate/stream", json=body, timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        for chunk in r.iter_text():
            seen += chunk.count("event: message")
            if seen >= 3:
                break
        # Lite: the abort request, while its own fetch is torn down
        aborter = threading.Thread(
            target=lambda: httpx.post(url + "/api/extra/abort", json={"genkey": genkey}, timeout=30)
        )
        aborter.start()
    aborter.join()


def test_lite_abort_ten_times_logs_no_error(start_server) -> None:  # type: ignore[no-untyped-def]
    server: ServerProc = start_server("--ctx-size", "2048", "--durability", "write-behind", "--write-delay-ms", "0")
    before = httpx.get(server.url + "/api/extra/perf", timeout=30).json()["total_gens"]
    for i in range(10):
        _abort_mid_stream(server.url, f"KCPP{5000 + i}", "kb-abort")
    # the turn after the aborts runs to its end and is stored; it waits for the slot as Lite's request (no
    # slot id) waits in KoboldCpp's queue: an abort that found its stream already closed answers at once,
    # while that closed stream's generation may still be leaving the slot
    body = lite_body(STORY, "KCPP5999", max_length=4, stop_sequence=[], id_slot="kb-abort", wait=True)
    out = httpx.post(server.url + "/api/v1/generate", json=body, timeout=120).json()
    assert out["results"][0]["finish_reason"] == "length"
    perf = httpx.get(server.url + "/api/extra/perf", timeout=30).json()
    assert perf["total_gens"] == before + 11 and perf["stop_reason"] == 0
    httpx.post(server.url + "/api/v1/slots/kb-abort/save", timeout=60)
    log = server.log_path.read_text()
    errors = [line for line in log.splitlines() if "error" in line.lower() and "write-behind" in line]
    assert not errors, errors
    assert " ERROR " not in log and "[error" not in log.lower() and "Traceback" not in log, log[-4000:]
