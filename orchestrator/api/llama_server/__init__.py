"""llama-server's API: ``/completion``, ``/props`` and the slot API (``/slots``)."""
