"""What the two processes agree on: imported by the engine worker and by the orchestrator, free of llama.cpp.

- :mod:`contract.protocol`: every message between the orchestrator and an engine worker.
- :mod:`contract.options`: the request options a generation carries (sampling, attention capture).
- :mod:`contract.framing`: frames on the worker's stream, worker addresses.
- :mod:`contract.buffers`, :mod:`contract.heap`: receive buffers and the allocator setting for them.
- :mod:`contract.flow`: a generation's flow-control window.
- :mod:`contract.errors`: the error codes both processes report.
- :mod:`contract.settings`: the engine settings, declared once.
- :mod:`contract.model_facts`, :mod:`contract.kv_types`: what the worker reports of its model and KV cache.
"""
