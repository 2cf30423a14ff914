"""The tool-call formats models write, read from their chat templates (`--tool-call-parser`).

    glm47        GLM-4.7 / GLM-5 (the `glm_moe_dsa` default), calls written back to back:
                 <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
    glm45        GLM-4.5 / 4.6: the same tags with a newline after the name and after each tag pair
    deepseekv31  DeepSeek-V3.1 and V3.2-Exp:
                 <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseekv32  DeepSeek-V3.2 (the `deepseek_v32` default), DSML:
                 <｜DSML｜function_calls>
                 <｜DSML｜invoke name="NAME">
                 <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
                 </｜DSML｜invoke>
                 </｜DSML｜function_calls>
    deepseekv4   DeepSeek-V4 (the `deepseek_v4` default): DSML with a `tool_calls` block

In the XML formats (GLM, DSML) a string argument is written raw and any other value as JSON: GLM's
templates write `v | tojson` unless v is a string, DSML says which with `string="..."`; reading
back, a GLM value is raw when the tool's schema says the argument is a string, else JSON if it
parses. OpenAI's `arguments` is a JSON text; while a call streams, `Scan` gives the stable prefix of
that text (it only grows), so the streamed fragments concatenate to the final arguments.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

from dhisparse.server.tools.spec import Tool

Literal = Callable[[str], str]  # marker text -> a Lark literal (a quoted string, or a special token)


@dataclass
class PartialCall:
    """One call as far as the text shows it. `arguments`: the stable prefix of its JSON text."""

    name: str
    arguments: str = ""
    closed: bool = False


@dataclass
class Scan:
    """What a model's output text says so far. content: the text before the calls (a possible
    start of a call marker at the end is held back until it resolves); trailing: text after them."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)
    trailing: str = ""


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _stable(text: str) -> str:
    """Content that can be sent while streaming: whitespace at the end waits (it is dropped if a
    call follows)."""
    return text.rstrip()


def is_prefix(rest: str, marker: str) -> bool:
    return len(rest) < len(marker) and marker.startswith(rest)


def kv_json(pairs: list[tuple[str, object]], closed: bool) -> str:
    """The stable prefix of `{"k": v, ...}` for the pairs seen so far ("{" waits for the first pair)."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    if not pairs and not closed:
        return ""
    return "{" + body + ("}" if closed else "")


def json_value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def arg_value(tool: Tool | None, key: str, text: str) -> object:
    if tool is not None and tool.is_string(key):
        return text
    return json_value(text.strip())


def compact_schema(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}} if "x-guidance" not in schema else schema)


class ToolFormat(ABC):
    """One model family's tool-call syntax: read it (`scan`), write it (`render_calls`, for the
    built-in default chat template), describe it (`system_prompt`, same), and constrain generation
    to it (`lark`, for tool_choice "required" / a named function)."""

    name: str
    start: str  # the marker that opens a model's calls

    def scan(self, text: str, tools: dict[str, Tool], final: bool) -> Scan:
        """Parse `text` (the whole output so far); `final`: no more text will come."""
        i = text.find(self.start)
        if i < 0:
            return Scan(text if final else _stable(text[: len(text) - held_back(text, self.start)]))
        calls, end = self.scan_calls(text, i, tools, final)
        if final and (not calls or not calls[0].name):  # a marker and no readable call: it is text
            return Scan(text)
        trailing = "" if end is None else text[end:]
        content = text[:i].rstrip() if calls else text[:i]
        return Scan(content if final else _stable(text[:i]), calls, trailing if trailing.strip() else "")

    @abstractmethod
    def scan_calls(self, text: str, i: int, tools: dict[str, Tool], final: bool) -> tuple[list[PartialCall], int | None]:
        """The calls of the block starting at text[i]; the end of the block (None: not ended)."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """(name, arguments) pairs as the model writes them."""

    @abstractmethod
    def lark(self, tools: list[Tool], many: bool, lit: Literal) -> str:
        """A Lark grammar: one call (`many` False) or one or more of the given tools."""

    def system_prompt(self, tools: list[Tool]) -> str:
        """How the built-in default template tells the model about `tools` (checkpoints with their
        own chat template render tools themselves)."""
        sigs = "\n".join(json.dumps(t.template_dict(), ensure_ascii=False) for t in tools)
        example = self.render_calls([("NAME", {"ARGUMENT": "VALUE"})])
        return (f"# Tools\n\nYou may call these functions (JSON signatures, one per line):\n<tools>\n{sigs}\n</tools>\n\n"
                f"To call one, write:\n{example}")


def text_until(rid: str, close: list[str], lit: Literal, schema: dict | None = None) -> tuple[str, list[str]]:
    """(expansion, rules) of a raw-text value ended by the pieces of `close`. A string schema's
    `enum` becomes the alternatives and its minLength / maxLength bound the text (other string
    keywords, such as `pattern`, are not enforced). A special-token end is its own token, so a
    greedy text lexeme stops at it; a textual end is the lexeme's suffix (the text cannot contain it)."""
    schema = schema or {}
    ends = " ".join(lit(c) for c in close if c)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(lit(e) for e in enum) + ") " + ends, []
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    body = "(?s:.*)" if lo is None and hi is None else f"(?s:.){{{int(lo or 0)},{'' if hi is None else int(hi)}}}"
    if not lit(close[0]).startswith('"'):
        return f"{rid}_text {ends}", [f"{rid}_text: /{body}/"]
    return f"{rid}_text", [f"{rid}_text[suffix={json.dumps(''.join(close))}]: /{body}/"]


def arg_schema(tool: Tool, key: str) -> dict:
    props = tool.parameters.get("properties") or {}
    return props.get(key) if isinstance(props.get(key), dict) else {}


def _keys(tool: Tool) -> list[tuple[str, bool]]:
    """(argument, required) in the schema's order."""
    props = tool.parameters.get("properties") or {}
    req = set(tool.parameters.get("required") or ())
    return [(k, k in req) for k in props]


def _calls_rule(names: list[str], many: bool, sep: str, lit: Literal) -> list[str]:
    one = " | ".join(names)
    rules = [f"call: {one}"]
    if many:
        return ["start: call (" + (f"{lit(sep)} " if sep else "") + "call)*"] + rules
    return ["start: call"] + rules
