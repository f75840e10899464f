"""Output parsers: one per tool-call format (registered by name, :mod:`.base`), and the reasoning parser.

The built-in tool formats, in the order detection tries them (their ``rank``): :mod:`.hermes`,
:mod:`.mistral`, :mod:`.llama3`, :mod:`.generic`.  A template none of them reads is ``unknown``.
Adding a format is a module here and its name in the import below (importing registers it).
"""

from orchestrator.generation.parsers import generic, hermes, llama3, mistral  # noqa: F401
