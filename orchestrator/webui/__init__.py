"""The chat page at ``/``: plain static files that use the public API only (``--no-webui`` turns it off)."""
