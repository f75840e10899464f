"""HTTP and WebSocket route handlers (one module per group of endpoints)."""
