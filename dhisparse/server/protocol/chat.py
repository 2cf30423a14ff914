"""POST /v1/chat/completions: `ChatRequest` and its messages (text content, an assistant's tool
calls, a tool's answer), and the messages as chat templates read them (`chat_messages`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dhisparse.server.protocol.common import MAX_LOGPROBS, STRICT, CommonRequest, MaxTokens
from dhisparse.server.protocol.errors import ApiError, quote

MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = STRICT

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history (OpenAI: arguments is a JSON string)."""

    model_config = STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOL_CALLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers


class ChatRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description=f"up to {MAX_TOOLS} functions: {{'type': 'function', 'function': {{name, description, parameters}}}}")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (vLLM / SGLang), e.g. {'enable_thinking': false}")


def message_text(content: str | list[ContentPart] | None) -> str:
    """Chat content (a string or a list of {"type": "text", "text": ...} parts) -> text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise ApiError(f"content part type {quote(part.type)} is not supported; send text parts",
                           param="messages")
        parts.append(part.text or "")
    return "".join(parts)


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as chat templates read them: role, content text, and for an assistant's calls
    `tool_calls` [{id, type, function: {name, arguments}}] (arguments as sent: server/chat.py turns
    them into objects), for a tool's answer `tool_call_id`."""
    if not req.messages:
        raise ApiError("messages is empty; send at least one message", param="messages")
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": m.role, "content": message_text(m.content)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(f"only assistant messages carry tool_calls, not {m.role!r} ones", param="messages")
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
