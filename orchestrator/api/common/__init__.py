"""What the API surfaces share, and nothing surface-specific: every surface imports this package and the domain,
never another surface.

- :mod:`~orchestrator.api.common.wire`: token text, attention, context shift, prompt progress, message spans.
- :mod:`~orchestrator.api.common.generate`: the generate body and its canonical form.
- :mod:`~orchestrator.api.common.chat`: a chat request's prompt (template, tools).
- :mod:`~orchestrator.api.common.completion`: llama.cpp's completion object (``/completion``, OpenAI's ``__verbose``).
- :mod:`~orchestrator.api.common.timings`: llama-server's ``timings``.
- :mod:`~orchestrator.api.common.kobold`: KoboldCpp's generate semantics (the KoboldCpp and native generate routes).
- :mod:`~orchestrator.api.common.run`: running a generation for an answer; the compatible surfaces' error shape.
"""
