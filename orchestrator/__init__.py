"""Orchestrator: the Litestar API, slots, scheduling onto engine sequences, persistence."""
