"""Choosing a tool-call format, and turning a choice's output into OpenAI `tool_calls`.

`ToolCallParser` follows one choice's output text. While streaming, `feed(text_so_far)` returns
the deltas that became certain - content, a call's opening (index, id, name) and fragments of its
arguments - and `finish()` the rest; a whole response calls `finish()` once. Because both paths
read the same `Scan`s, a streamed choice's deltas concatenate to exactly the non-streamed message.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from dhisparse.server.tools.deepseek import DeepSeekJsonFormat, DsmlFormat
from dhisparse.server.tools.formats import Scan, ToolFormat
from dhisparse.server.tools.glm import GlmFormat
from dhisparse.server.tools.spec import Tool

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    GlmFormat("glm47", ""), GlmFormat("glm45", "\n"), DeepSeekJsonFormat(),
    DsmlFormat("deepseekv32", "function_calls"), DsmlFormat("deepseekv4", "tool_calls"))}
PARSER_NAMES = ("auto",) + tuple(FORMATS)
BY_ARCHITECTURE = {"glm_moe_dsa": "glm47", "deepseek_v32": "deepseekv32", "deepseek_v4": "deepseekv4"}
# markers a chat template writes when it renders a model's calls -> the format (first match wins)
BY_TEMPLATE = (("｜DSML｜function_calls", "deepseekv32"), ("｜DSML｜tool_calls", "deepseekv4"),
               ("<｜tool▁sep｜>", "deepseekv31"), ("\\n<arg_key>", "glm45"), ("<arg_key>", "glm47"))


def choose_format(flag: str | None, architecture: str, template: str | None) -> ToolFormat:
    """`--tool-call-parser`: a format name, or "auto"/None = what the checkpoint's chat template
    writes, else the architecture's default (GLM-5: glm47, DeepSeek-V3.2: deepseekv32, V4: deepseekv4)."""
    if flag not in (None, "auto"):
        if flag not in FORMATS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_NAMES)}; got {flag!r}")
        return FORMATS[flag]
    for marker, name in BY_TEMPLATE:
        if template and marker in template:
            return FORMATS[name]
    return FORMATS[BY_ARCHITECTURE.get(architecture, "glm47")]


@dataclass
class ToolDelta:
    """One `delta.tool_calls` entry: the call's opening (id and name) or an arguments fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        d["function"] = fn
        return d


@dataclass
class Parsed:
    """A choice's message: content (None when empty and there are calls) and its tool calls."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallParser:
    """One choice's tool-call reading. `single`: keep only the first call (parallel_tool_calls false)."""

    def __init__(self, fmt: ToolFormat, tools: tuple[Tool, ...], single: bool = False) -> None:
        self.fmt, self.tools, self.single = fmt, {t.name: t for t in tools}, single
        self.content_sent = 0
        self.args_sent: list[int] = []
        self.ids: list[str] = []
        self.trailing_sent = 0
        self.last: Scan | None = None

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        """Text so far -> (new content, new tool-call deltas)."""
        return self._advance(self.fmt.scan(text, self.tools, final=False))

    def finish(self, text: str) -> tuple[str, list[ToolDelta]]:
        """The whole text -> what is left to send."""
        return self._advance(self.fmt.scan(text, self.tools, final=True))

    def _advance(self, scan: Scan) -> tuple[str, list[ToolDelta]]:
        calls = scan.calls[:1] if self.single else scan.calls
        self.last = Scan(scan.content, calls, scan.trailing)
        content = scan.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(scan.content))
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.args_sent.append(0)
                deltas.append(ToolDelta(i, "", self.ids[i], call.name))
            new = call.arguments[self.args_sent[i]:]
            if new:
                deltas.append(ToolDelta(i, new))
                self.args_sent[i] = len(call.arguments)
        content += scan.trailing[self.trailing_sent:]
        self.trailing_sent = max(self.trailing_sent, len(scan.trailing))
        return content, deltas

    def message(self) -> Parsed:
        """The whole message after `finish` (what a non-streamed response returns)."""
        scan = self.last or Scan("")
        text = scan.content + scan.trailing
        calls = [{"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(scan.calls)]
        return Parsed(text if (text or not calls) else None, calls)
