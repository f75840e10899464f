"""Chat messages to a prompt with the model's own chat template (GGUF ``tokenizer.chat_template``).

The template is rendered with jinja2's ``ImmutableSandboxedEnvironment``, as
llama-cpp-python's ``Jinja2ChatFormatter`` (``llama_cpp/llama_chat_format.py``) and
llama-server's ``--jinja`` mode do: ``trim_blocks``/``lstrip_blocks``, the globals
``raise_exception`` and ``strftime_now``, and the variables ``messages``, ``bos_token``,
``eos_token``, ``add_generation_prompt`` and ``tools``; ``tojson`` is transformers' (no HTML
escaping, ``indent`` taken), as tool-calling templates are written for it.  There is no hand-written
template here: a model without one gets ``INVALID_REQUEST`` on chat requests.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from contract.errors import ErrorCode
from orchestrator.service_error import ServiceError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' ``tojson`` filter (``utils/chat_template_utils.py``): plain ``json.dumps``,
    without jinja2's HTML escaping, taking ``indent`` as tool-calling templates pass it."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_MEDIA = {"image_url": "image", "input_audio": "audio"}


def message_text(content: Any) -> str:
    """An OpenAI message ``content``: a string, null, or a list of ``{"type": "text", "text"}`` parts.

    Raises ``INVALID_REQUEST`` for other part types (images, audio): this server reads text only
    (``image_url`` and ``input_audio`` parts with llama-server's message for a model without a
    multimodal projector, ``tools/server/server-common.cpp``).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            media = _MEDIA.get(str(part.get("type"))) if isinstance(part, dict) else None
            if media is not None:
                raise ServiceError(
                    ErrorCode.INVALID_REQUEST,
                    f"{media} input is not supported - hint: if this is unexpected, you may need to provide the mmproj",
                )
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServiceError(
                    ErrorCode.INVALID_REQUEST, "message content parts must be {'type': 'text', 'text': str}"
                )
            out.append(part["text"])
        return "".join(out)
    raise ServiceError(ErrorCode.INVALID_REQUEST, "message content must be a string or a list of text parts")


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns OpenAI ``messages`` into prompt text."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        if not source:
            raise ServiceError(ErrorCode.INVALID_REQUEST, "this model has no chat template (tokenizer.chat_template)")
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"the model's chat template does not compile: {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (each ``{"role", "content", ...}``; none: what the template
        makes of an empty list, as llama-server renders it).  ``variables``: more names the template may
        read (llama-server's ``chat_template_kwargs``, e.g. ``enable_thinking``); they never replace the
        names above.

        Raises ``INVALID_REQUEST`` when a message is malformed or the template refuses it
        (``raise_exception``, e.g. roles out of order).
        """
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ServiceError(ErrorCode.INVALID_REQUEST, "each message needs a string 'role'")
            clean.append({**m, "content": message_text(m.get("content"))})
        try:
            names = {
                "messages": clean,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_generation_prompt": add_generation_prompt,
                "tools": tools,
            }
            return self.template.render({**(variables or {}), **names})
        except jinja2.TemplateError as exc:
            raise ServiceError(ErrorCode.INVALID_REQUEST, f"chat template error: {exc}") from exc
