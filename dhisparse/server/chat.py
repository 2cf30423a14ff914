"""A chat request's prompt and tool handling: what the chat template gets, and how its output is read.

1. `tools` / `tool_choice` are validated (tools/spec.py). tool_choice "none" hides the tools from
   the template and reads no calls (vLLM's default); "auto" shows them and reads the output;
   "required" and a named function also constrain decoding to the model's call format (a grammar,
   so it cannot be combined with response_format).
2. The history's assistant `tool_calls` get their `arguments` as objects (chat templates iterate
   them, as with transformers); tool answers keep their `tool_call_id`.
3. A checkpoint's own template receives `tools` and the messages as they are. The built-in
   default template reads only role and content, so the server writes the tools (the format's
   system prompt) and the history's calls (in the format) into the text first.
4. Output is decoded with special tokens kept when calls are read (a format's markers may be
   special tokens), and each choice gets a `ToolCallParser`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dhisparse.core.params import SamplingParams
from dhisparse.server.protocol.chat import ChatRequest, chat_messages
from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.tools import (Tool, ToolCallParser, ToolChoice, ToolFormat, call_arguments, parse_tool_choice,
                                    parse_tools, tool_grammar)

RESERVED_TEMPLATE_VARS = ("messages", "tools", "bos_token", "eos_token")


@dataclass(frozen=True)
class ToolReading:
    """How a request's choices are read: the format, the offered tools, at most one call or not."""

    fmt: ToolFormat
    tools: tuple[Tool, ...]
    single: bool

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt, self.tools, self.single)


@dataclass(frozen=True)
class ChatSetup:
    """messages / tools / template_kwargs for the chat template; `reading` (None: no calls read)."""

    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    reading: ToolReading | None
    choice: ToolChoice

    def render(self, tokenizer) -> str:
        return tokenizer.apply_chat_template(self.messages, tools=self.tools, **self.template_kwargs)

    def sampling(self, params: SamplingParams, literal) -> SamplingParams:
        """The request's params with what reading calls needs: special tokens kept in the text,
        and for tool_choice "required" / a named function the grammar of the call format."""
        if self.reading is None:
            return params
        if not self.choice.constrained:
            return dataclasses.replace(params, skip_special_tokens=False)
        grammar = tool_grammar(self.reading.fmt, self.reading.tools, self.choice, not self.reading.single, literal)
        return dataclasses.replace(params, skip_special_tokens=False, grammar=grammar)


def chat_setup(body: ChatRequest, fmt: ToolFormat, default_template: bool) -> ChatSetup:
    """Validate the request's tool fields and build what the template and the formatter need."""
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    rf = body.response_format
    if choice.constrained and rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise ApiError(f"tool_choice {choice.mode!r} constrains the output to tool calls; it cannot be combined "
                       "with response_format", param="tool_choice")
    kwargs = dict(body.chat_template_kwargs or {})
    bad = [k for k in RESERVED_TEMPLATE_VARS if k in kwargs]
    if bad:
        raise ApiError(f"chat_template_kwargs may not set {bad}: the server sets them", param="chat_template_kwargs")
    if "add_generation_prompt" in kwargs and not isinstance(kwargs["add_generation_prompt"], bool):
        raise ApiError("chat_template_kwargs.add_generation_prompt must be a boolean", param="chat_template_kwargs")
    messages = _with_arguments(chat_messages(body))
    shown = list(tools) if choice.mode != "none" else []
    if default_template:
        messages = _written_out(messages, shown, fmt)
    single = body.parallel_tool_calls is False or choice.mode == "function"
    reading = ToolReading(fmt, tools, single) if choice.mode != "none" else None
    return ChatSetup(messages, [t.template_dict() for t in shown] or None, kwargs, reading, choice)


def _with_arguments(messages: list[dict]) -> list[dict]:
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            fn = call["function"]
            fn["arguments"] = call_arguments(fn["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
    return messages


def _written_out(messages: list[dict], tools: list[Tool], fmt: ToolFormat) -> list[dict]:
    """For the default template: the tools as a system message, each call in the format's text."""
    out = [{"role": "system", "content": fmt.system_prompt(tools)}] if tools else []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            text = fmt.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            m = {**m, "content": m["content"] + text}
        out.append({"role": m["role"], "content": m["content"]})
    return out
