"""HTTP and WebSocket routes: one package per API surface (native, OpenAI, Anthropic, llama-server, KoboldCpp),
siblings that import none of each other, over :mod:`orchestrator.api.common`: the wire types and helpers they
share (attention, token text, progress, timings, llama.cpp's completion object, the generate body, the chat
prompt, KoboldCpp's generate semantics, running a generation for a non-streamed or streamed answer).
"""
