"""OpenAI's Responses API: wire types (``protocol``), shaping (``serving``), the route (``routes``)."""
