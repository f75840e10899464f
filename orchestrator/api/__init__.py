"""HTTP and WebSocket routes, one package per API surface (native, OpenAI, llama-server, KoboldCpp) and the pieces
the client-compatible surfaces share (:mod:`orchestrator.api.compat`).
"""
