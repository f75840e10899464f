"""The engine client side: the typed interface the orchestrator holds an engine through, the worker process client,
how the worker is launched.
"""
