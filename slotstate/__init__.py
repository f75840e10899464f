"""Slot-state byte formats, shared by the engine worker and the orchestrator (no llama.cpp here).

- :mod:`slotstate.seq_state`: llama.cpp's sequence state (``llama_state_seq_get_data``), parsed and
  checked before llama.cpp sees it.
- :mod:`slotstate.ggsq`: llama.cpp's sequence-state files (``llama_state_seq_save_file``), llama-server's
  slot files.
- :mod:`slotstate.ses1`: the SES1 envelope of ``save-state``/``restore-state`` (docs/api.md, "Slots").
- :mod:`slotstate.codec`: compression codecs of stored blobs.
- :mod:`slotstate.errors`: :class:`BadStateError`, raised by all of them.
"""
