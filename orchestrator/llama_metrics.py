"""llama-server's ``llamacpp:*`` metrics, served in ``GET /metrics`` beside slotserve's own.

llama-server writes them itself (``server_task_result_metrics::to_metrics`` in llama.cpp's
``tools/server/server-task.cpp``): for each metric a ``# HELP``, a ``# TYPE`` and one sample,
counters first, then gauges, in the order below.  They are written here the same way rather
than with prometheus-client because its text exposition names a counter's ``# TYPE`` line
``<name>_total`` whatever the counter is called, and llama-server's ``llamacpp:n_tokens_max``
is a counter without that suffix (scrapers and llama.cpp's own tests match the ``# TYPE`` line
to the sample by name).

Values come from each finished generation (:class:`contract.protocol.Done`), as llama-server
counts its tasks:

* ``prompt_tokens_total`` / ``prompt_seconds_total``: tokens prefilled (not served from the KV
  cache) and the time they took; ``prompt_tokens_cached_total``: tokens served from the cache;
* ``tokens_predicted_total`` / ``tokens_predicted_seconds_total``: tokens generated and the
  time after the first (which comes from the prompt's logits);
* ``n_decode_total``: the ``llama_decode`` steps each generation needed on its own (its prompt
  in chunks of ``n_batch`` tokens, then one step per token after the first).  slotserve's
  engine decodes concurrent sequences in one call, as llama-server does, so under concurrency
  this counts more steps than calls were made;
* ``n_tokens_max``: the longest sequence (prompt plus generated tokens) seen;
* ``prompt_tokens_seconds`` / ``predicted_tokens_seconds``: throughput since the previous
  scrape (llama-server's "bucket", reset by each ``GET /metrics``), generation over the steps
  after each generation's first token;
* ``requests_processing``: slots a request uses now; ``requests_deferred``: requests waiting;
* the speculative-decoding counters are 0 (slotserve does not offer it), and
  ``n_busy_slots_per_decode`` is 0: the engine does not report its batches' make-up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from contract.protocol import Done

PROCESS_START_HEADER = "Process-Start-Time-Unix"
"""llama-server's ``/metrics`` response header: when the server started, Unix seconds (``server-context.cpp``)."""


@dataclass
class _Rate:
    """Tokens, their decode steps and the microseconds they took (llama-server's
    ``server_metrics::bucket``: a generation's first token costs no step)."""

    count: int = 0
    steps: int = 0
    time_us: float = 0.0

    def add(self, n: int, steps: int, t_ms: float) -> None:
        self.count += n
        self.steps += steps
        self.time_us += t_ms * 1000

    def per_second(self) -> float:
        return 1e6 * self.steps / self.time_us if self.time_us > 0 else 0.0


@dataclass
class LlamaServerMetrics:
    """llama-server's counters for this process (see the module docstring).  ``n_batch``: the
    engine's tokens per ``llama_decode`` (``--batch-size``), used to count prefill steps;
    ``t_start``: when the counters began, Unix seconds (the ``Process-Start-Time-Unix`` header)."""

    n_batch: int = 512
    t_start: int = field(default_factory=lambda: int(time.time()))
    prompt: _Rate = field(default_factory=_Rate)
    predict: _Rate = field(default_factory=_Rate)
    prompt_bucket: _Rate = field(default_factory=_Rate)
    predict_bucket: _Rate = field(default_factory=_Rate)
    n_prompt_cached: int = 0
    n_decode: int = 0
    n_tokens_max: int = 0

    def record(self, done: Done) -> None:
        """Count a finished generation."""
        for rate in (self.prompt, self.prompt_bucket):
            rate.add(done.n_prefilled, done.n_prefilled, done.t_prefill_ms)
        for rate in (self.predict, self.predict_bucket):
            rate.add(done.n_generated, max(done.n_generated - 1, 0), done.t_generate_ms)
        self.n_prompt_cached += done.n_cached
        self.n_decode += math.ceil(done.n_prefilled / self.n_batch) + max(done.n_generated - 1, 0)
        self.n_tokens_max = max(self.n_tokens_max, done.n_prompt + done.n_generated)

    def record_abandoned(self, n_generated: int) -> None:
        """Count the tokens of a generation whose client left before its end (no timings)."""
        self.predict.count += n_generated

    def render(self, requests_processing: int, requests_deferred: int) -> str:
        """llama-server's exposition text (``to_metrics``), and a new throughput bucket."""
        counters: list[tuple[str, str, float]] = [
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", self.prompt.count),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", self.n_prompt_cached),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt.time_us / 1e6),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predict.count),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predict.time_us / 1e6),
            (
                "n_decode_total",
                "Number of llama_decode() steps, each generation counted apart",
                self.n_decode,
            ),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated (not offered)", 0),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted (not offered)", 0),
            ("spec_decode_num_drafts_total", "Speculative: Total verification steps (not offered)", 0),
        ]
        gauges: list[tuple[str, str, float]] = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", self.prompt_bucket.per_second()),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", self.predict_bucket.per_second()),
            ("requests_processing", "Number of requests processing", requests_processing),
            ("requests_deferred", "Number of requests deferred", requests_deferred),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call (not measured)", 0),
        ]
        self.prompt_bucket, self.predict_bucket = _Rate(), _Rate()
        lines = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in items:
                lines += [
                    f"# HELP llamacpp:{name} {help_text}",
                    f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {value!r}",
                ]
        return "\n".join(lines) + "\n"


LLAMA_SERVER = LlamaServerMetrics()
"""This process's llama-server counters (fed by :func:`orchestrator.metrics.record_generation`)."""
