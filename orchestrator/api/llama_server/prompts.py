"""llama-server's ``prompt`` forms on ``/completion``: one prompt or several, each text, token ids,
text and ids mixed, or ``{"prompt_string": ...}`` (llama.cpp ``tools/server/server-common.cpp``:
``tokenize_input_prompts``, ``tokenize_input_subprompt``, ``tokenize_mixed``; README "POST
/completion", ``prompt``).

* a string, a list of ids, or a list mixing ids and strings: one prompt (in a mixed list only the
  first element, if it is a string, gets the BOS token);
* ``{"prompt_string": <one of the above>}``: one prompt; ``multimodal_data`` is refused
  (``INVALID_REQUEST``: this server reads text only, as llama-server without ``--mmproj``);
* a list holding no number: several prompts, one per element; each is answered with its
  ``index``.
"""

from __future__ import annotations

from typing import Any

from contract.errors import ErrorCode
from orchestrator.api.common.completion import PromptObject, SubPrompt
from orchestrator.services import Services
from orchestrator.web.errors import ApiError


def split_prompts(prompt: Any) -> list[SubPrompt]:
    """The prompts of a ``prompt`` field: several when it is a list holding no number, else one
    (llama-server's ``tokenize_input_prompts``); ``INVALID_REQUEST`` when empty."""
    if isinstance(prompt, list) and not any(isinstance(p, int) for p in prompt):
        if not prompt:
            raise ApiError(ErrorCode.INVALID_REQUEST, '"prompt" must not be empty')
        return list(prompt)
    return [prompt]


async def subprompt_ids(services: Services, prompt: SubPrompt, add_special: bool = True) -> list[int]:
    """One prompt's token ids: text tokenized with special tokens parsed (``add_special`` for a
    text, and for a mixed list's first element when it is text), ids as they are."""
    if isinstance(prompt, PromptObject):
        if prompt.multimodal_data:
            raise ApiError(
                ErrorCode.INVALID_REQUEST,
                "Multimodal data provided, but model does not support multimodal requests.",
            )
        prompt = prompt.prompt_string
    if isinstance(prompt, str):
        return (await services.engine.tokenize(prompt, add_special, True)).ids
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += (await services.engine.tokenize(part, add_special and i == 0, True)).ids
        elif isinstance(part, int):
            ids.append(part)
        else:
            raise ApiError(ErrorCode.INVALID_REQUEST, '"prompt" elements must be strings or token ids')
    return ids
