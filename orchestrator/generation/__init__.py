"""Generation: a validated request run on its slot (the service), stop strings, chat templates."""
