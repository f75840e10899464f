"""Ollama's API (docs/api.md, "Ollama API")."""
