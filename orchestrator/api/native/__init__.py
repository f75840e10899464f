"""slotserve's native API: generation over HTTP, SSE and WebSocket, previews, model facts, classification, health."""
