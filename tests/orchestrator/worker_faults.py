"""A real engine worker with a start-up fault, for the start-up tests (run as a script).

``SLOTSERVE_TEST_FAULT`` chooses it:

* ``segv-unless-no-repack``: the self-check dies by SIGSEGV unless the worker was started
  with repacking off (``repack: false`` in its settings, or ``--no-repack``; the shape of llama.cpp's extra-buffer-type crash on AMX hosts);
* ``segv-always``: the self-check always dies by SIGSEGV;
* ``slow-load``: the model load reports its progress slowly (0.1 s per report), so a
  client can watch ``/health`` say ``loading`` with a fraction.

Everything else is the worker ``slotserve serve`` starts (``engine.worker``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from engine import engine, worker

FAULT = os.environ.get("SLOTSERVE_TEST_FAULT", "")


def _segv(_engine: object) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


if FAULT == "segv-always" or (
    FAULT == "segv-unless-no-repack" and worker.parse_args(sys.argv[1:])[1].repack is not False
):
    engine.run_self_check = _segv  # type: ignore[assignment]

if FAULT == "slow-load":
    _Model = worker.Model

    class SlowModel(_Model):  # type: ignore[misc, valid-type]
        def __init__(self, *args, on_progress=None, **kw) -> None:  # type: ignore[no-untyped-def]
            def slow(fraction: float) -> None:
                time.sleep(0.1)
                if on_progress is not None:
                    on_progress(fraction)

            super().__init__(*args, on_progress=slow, **kw)

    worker.Model = SlowModel  # type: ignore[misc]

if __name__ == "__main__":
    sys.exit(worker.run_worker_process(sys.argv[1:]))
