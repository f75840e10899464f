"""Chat messages to prompt tokens as llama-server does, and its two endpoints that stop there.

:func:`chat_prompt` renders OpenAI ``messages`` with the model's chat template
(:class:`orchestrator.generation.chat_template.ChatTemplate`) under llama-server's rules
(``tools/server/server-common.cpp``, ``oaicompat_chat_params_parse``): a last ``assistant``
message is a prefill that the model continues (rendered without it, then its text appended,
llama-server's ``continue_final_message`` "auto"), and two ``assistant`` messages at the end are
refused with llama-server's message.  ``POST /apply-template`` answers the prompt text
(``{"prompt"}``), ``POST /chat/completions/input_tokens`` (and ``/v1/...``) its token count
(``{"input_tokens"}``), both without generating (llama-server's ``post_apply_template`` and
``handle_count_tokens``).
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, post

from contract.errors import ErrorCode
from orchestrator.api.compat import COMPAT_ERRORS
from orchestrator.api.llama_server.protocol import AppliedTemplate, ChatPromptBody, InputTokens
from orchestrator.generation.chat_template import ChatTemplate, message_text
from orchestrator.services import Services
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES, ApiError


def chat_prompt(services: Services, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """The prompt text of ``messages`` (see the module docstring); ``INVALID_REQUEST`` for
    malformed messages, two ``assistant`` messages at the end, or a template that refuses them."""
    info = services.generation.info
    special = info.special_tokens
    template = ChatTemplate(info.chat_template, str(special.get("bos_token", "")), str(special.get("eos_token", "")))
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles[-2:] == ["assistant", "assistant"]:
        raise ApiError(ErrorCode.INVALID_REQUEST, "Cannot have 2 or more assistant messages at the end of the list.")
    if len(messages) > 1 and roles[-1] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = message_text(messages[-1].get("content"))
        return template.render(messages[:-1], add_generation_prompt=True, tools=tools) + prefill
    return template.render(messages, add_generation_prompt=True, tools=tools)


async def chat_ids(services: Services, text: str) -> list[int]:
    """``text`` (a rendered chat prompt) tokenized; BOS added unless the template wrote it."""
    bos = str(services.generation.info.special_tokens.get("bos_token", ""))
    return (await services.engine.tokenize(text, not (bos and text.startswith(bos)), True)).ids


class LlamaChatController(Controller):
    """llama-server's ``/apply-template`` and ``/chat/completions/input_tokens``."""

    exception_handlers = COMPAT_ERRORS  # type: ignore[assignment]

    @post(
        "/apply-template",
        status_code=200,
        summary="llama-server: the prompt the chat template makes of messages",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def apply_template(self, services: Services, data: ChatPromptBody) -> AppliedTemplate:
        return AppliedTemplate(prompt=chat_prompt(services, data.messages, data.tools))

    @post(
        ["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"],
        status_code=200,
        summary="llama-server: the token count of a chat completion's prompt",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def input_tokens(self, services: Services, data: ChatPromptBody) -> InputTokens:
        ids = await chat_ids(services, chat_prompt(services, data.messages, data.tools))
        return InputTokens(input_tokens=len(ids))
