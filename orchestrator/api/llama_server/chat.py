"""llama-server's two chat endpoints that stop at the prompt: ``POST /apply-template`` answers the
prompt text (``{"prompt"}``), ``POST /chat/completions/input_tokens`` (and ``/v1/...``) its token count
(``{"input_tokens"}``), both without generating (llama-server's ``post_apply_template`` and
``handle_count_tokens``).  Both run :func:`orchestrator.api.common.chat.chat_prompt_text`, the
preparation the chat completion path runs (llama-server's rules for a last ``assistant`` message,
tools, tool calls and results), so their text and count are exactly the chat's prompt.
"""

from __future__ import annotations

from litestar import Controller, post

from orchestrator.api.common.chat import chat_prompt_ids, chat_prompt_text
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
        text, _ = chat_prompt_text(
            services, data.messages, data.tools, data.tool_choice, data.parallel_tool_calls, data.chat_template_kwargs
        )
        return AppliedTemplate(prompt=text)

    @post(
        ["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"],
        status_code=200,
        summary="llama-server: the token count of a chat completion's prompt",
        responses=COMPAT_ERROR_RESPONSES,
    )
    async def input_tokens(self, services: Services, data: ChatPromptBody) -> InputTokens:
        ids, _, _ = await chat_prompt_ids(
            services, data.messages, data.tools, data.tool_choice, data.parallel_tool_calls, data.chat_template_kwargs
        )
        return InputTokens(input_tokens=len(ids))
