"""Tool calls (function calling) for /v1/chat/completions: declared tools and tool_choice (spec.py),
the model families' call formats (formats.py, glm.py, deepseek.py), reading a choice's output into
`tool_calls`, streamed or whole (parser.py), and the grammar that makes tool_choice "required" or a
named function certain (`tool_grammar`)."""

from __future__ import annotations

from typing import Callable

import llguidance

from dhisparse.server.tools.formats import ToolFormat
from dhisparse.server.tools.parser import (FORMATS, PARSER_NAMES, Parsed, ToolCallParser, ToolDelta,
                                           choose_format)
from dhisparse.server.tools.spec import Tool, ToolChoice, call_arguments, parse_tool_choice, parse_tools


def tool_grammar(fmt: ToolFormat, tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool,
                 literal: Callable[[str], str]) -> str:
    """The llguidance grammar of tool_choice "required" (one or more calls of the tools; exactly one
    when parallel_tool_calls is false) or a named function (exactly one call of it), in the
    model's own call format. `literal` writes a marker as a Lark string or special token."""
    if choice.mode == "function":
        return llguidance.grammar_from("lark", fmt.lark([t for t in tools if t.name == choice.name], False, literal))
    return llguidance.grammar_from("lark", fmt.lark(list(tools), parallel, literal))


__all__ = ["FORMATS", "PARSER_NAMES", "Parsed", "Tool", "ToolCallParser", "ToolChoice", "ToolDelta", "ToolFormat",
           "call_arguments", "choose_format", "parse_tool_choice", "parse_tools", "tool_grammar"]
