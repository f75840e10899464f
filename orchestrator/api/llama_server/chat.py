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

from litestar import Controller, post

from orchestrator.api.common.chat import chat_ids, chat_prompt
from orchestrator.api.common.run import COMPAT_ERRORS
from orchestrator.api.llama_server.protocol import AppliedTemplate, ChatPromptBody, InputTokens
from orchestrator.services import Services
from orchestrator.web.errors import COMPAT_ERROR_RESPONSES


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
