"""Tools as a request declares them, and what `tool_choice` asks for.

A request's `tools` (OpenAI: [{"type": "function", "function": {"name", "description",
"parameters", "strict"}}]) become `Tool`s; `tool_choice` ("none" | "auto" | "required" |
{"type": "function", "function": {"name": ...}}) becomes a `ToolChoice`. Both are validated here,
so the parsers and grammar builders can trust them; a bad value is an ApiError naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from dhisparse.server.protocol.errors import ApiError, quote

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI: a-z, A-Z, 0-9, underscores and dashes, up to 64


@dataclass(frozen=True)
class Tool:
    """One function a request offers the model. `parameters` is its JSON schema ({} = any object)."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=dict)

    def param_type(self, key: str) -> Any:
        """The JSON-schema `type` of argument `key` (None when the schema does not say)."""
        props = self.parameters.get("properties")
        spec = props.get(key) if isinstance(props, dict) else None
        return spec.get("type") if isinstance(spec, dict) else None

    def is_string(self, key: str) -> bool:
        """Whether argument `key` is written raw (a string) rather than as JSON in the XML formats."""
        t = self.param_type(key)
        return t == "string" or (isinstance(t, list) and t and all(x in ("string", "null") for x in t))

    def template_dict(self) -> dict:
        """The tool as chat templates read it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """mode: "none" (tools are not shown and output is not parsed), "auto" (shown, output parsed),
    "required" (at least one call, enforced by a grammar), "function" (exactly one call of `name`)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "function")


def parse_tools(raw: list[dict] | None) -> tuple[Tool, ...]:
    """`tools` -> Tools; ApiError(param="tools") for anything malformed (their number is bounded by
    ChatRequest.tools' max_length, MAX_TOOLS, when the body is parsed)."""
    if not raw:
        return ()
    tools, seen = [], set()
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        fn = t["function"]
        name, desc, params = fn.get("name"), fn.get("description"), fn.get("parameters", {})
        if not isinstance(name, str) or not NAME.match(name):
            raise ApiError(f"tools[{i}].function.name {quote(name)} must be 1-64 letters, digits, '_', '-', '.' or ':'",
                           param="tools")
        if name in seen:
            raise ApiError(f"tools[{i}]: the function name {name!r} is declared twice", param="tools")
        if desc is not None and not isinstance(desc, str):
            raise ApiError(f"tools[{i}].function.description must be a string", param="tools")
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema of type 'object'", param="tools")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ApiError(f"tools[{i}].function has unknown field(s) {sorted(extra)}", param="tools")
        seen.add(name)
        tools.append(Tool(name, desc, params))
    return tuple(tools)


def parse_tool_choice(raw: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    """`tool_choice` -> ToolChoice (OpenAI's default: "auto" with tools, "none" without)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "auto", "required"):
        if raw != "none" and not tools:
            raise ApiError(f"tool_choice {raw!r} needs tools; send the functions the model may call", param="tool_choice")
        return ToolChoice(raw)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                       f"{{'name': ...}}}}; got {quote(raw)}", param="tool_choice")
    if name not in {t.name for t in tools}:
        raise ApiError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return ToolChoice("function", name)


def call_arguments(args: Any, where: str) -> dict:
    """An assistant message's tool-call `arguments` (a JSON string, as OpenAI sends them, or an
    object) -> the dict chat templates iterate."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ApiError(f"{where} is not valid JSON ({e.msg} at {e.pos})", param="messages") from None
        if isinstance(parsed, dict):
            return parsed
    raise ApiError(f"{where} must be a JSON object (as a string)", param="messages")
