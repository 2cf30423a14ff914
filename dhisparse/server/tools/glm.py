"""GLM's tool calls (glm47: GLM-4.7 / GLM-5; glm45: GLM-4.5 / 4.6), as their chat templates write them.

    glm47:  <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>
    glm45:  <tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>
            ^open     ^name      ^sep   ^ pairs: key, sep, value, sep, ...           ^close

Several calls follow one another (glm45 puts a newline before each). No block wraps them, so the
calls end where the text stops being another call.
"""

from __future__ import annotations

import json

from dhisparse.server.tools.formats import (Literal, PartialCall, ToolFormat, _calls_rule, _keys, arg_value,
                                            arg_schema, compact_schema, is_prefix, kv_json, text_until)
from dhisparse.server.tools.spec import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VAL_OPEN, VAL_CLOSE = "<arg_value>", "</arg_value>"


class GlmFormat(ToolFormat):
    """sep: "" (glm47) or "\\n" (glm45), written after the name and after each tag."""

    def __init__(self, name: str, sep: str) -> None:
        self.name, self.sep, self.start = name, sep, OPEN

    # -- reading ----------------------------------------------------------------------------------
    def scan_calls(self, text, i, tools, final):
        calls: list[PartialCall] = []
        pos = i
        while True:
            call, after = self._call(text, pos, tools, final)
            if call is None:
                return calls, (None if not final else pos)
            calls.append(call)
            if not call.closed:
                return calls, None if not final else len(text)
            j = len(text) - len(text[after:].lstrip())
            rest = text[j:]
            if rest.startswith(OPEN):
                pos = j
                continue
            if not final and (rest == "" or is_prefix(rest, OPEN)):
                return calls, None
            return calls, after

    def _call(self, text: str, pos: int, tools: dict[str, Tool], final: bool):
        """The call opening at text[pos] (None until its name is known) and where it ends."""
        body = pos + len(OPEN)
        ends = [k for k in (text.find(KEY_OPEN, body), text.find(CLOSE, body)) if k >= 0]
        if not ends:
            if not final:
                return None, pos
            ends = [len(text)]
        name = text[body:min(ends)].strip()
        tool = tools.get(name)
        pairs: list[tuple[str, object]] = []
        q = min(ends)
        while True:
            q = len(text) - len(text[q:].lstrip())
            if text.startswith(CLOSE, q):
                return PartialCall(name, kv_json(pairs, True), True), q + len(CLOSE)
            pair = self._pair(text, q)
            if pair is None:
                return PartialCall(name, kv_json(pairs, False), False), q
            key, value, q = pair
            pairs.append((key, arg_value(tool, key, value)))

    @staticmethod
    def _pair(text: str, q: int):
        if not text.startswith(KEY_OPEN, q):
            return None
        k_end = text.find(KEY_CLOSE, q)
        if k_end < 0:
            return None
        key = text[q + len(KEY_OPEN):k_end].strip()
        v = k_end + len(KEY_CLOSE)
        v = len(text) - len(text[v:].lstrip())
        if not text.startswith(VAL_OPEN, v):
            return None
        v_end = text.find(VAL_CLOSE, v)
        if v_end < 0:
            return None
        return key, text[v + len(VAL_OPEN):v_end], v_end + len(VAL_CLOSE)

    # -- writing ----------------------------------------------------------------------------------
    def render_calls(self, calls):
        s = self.sep
        out = []
        for name, args in calls:
            pairs = "".join(f"{KEY_OPEN}{k}{KEY_CLOSE}{s}{VAL_OPEN}{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                            f"{VAL_CLOSE}{s}" for k, v in args.items())
            out.append(f"{s}{OPEN}{name}{s}{pairs}{CLOSE}")
        return "".join(out)

    # -- constraining -----------------------------------------------------------------------------
    def lark(self, tools: list[Tool], many: bool, lit: Literal) -> str:
        s = self.sep
        rules = _calls_rule([f"call_{i}" for i in range(len(tools))], many, "", lit)
        for i, tool in enumerate(tools):
            head = " ".join(lit(x) for x in [s, OPEN, tool.name + s] if x)
            keys = _keys(tool)
            parts = []
            for j, (key, required) in enumerate(keys):
                rid = f"a_{i}_{j}"
                parts.append(rid if required else f"{rid}?")
                pre = " ".join(lit(x) for x in [KEY_OPEN, key, KEY_CLOSE, s, VAL_OPEN] if x)
                rules += self._value(rid, tool, key, pre, lit)
            if "properties" not in tool.parameters:  # arguments not declared: any key / value pairs
                parts.append(f"free_{i}*")
                k_exp, k_rules = text_until(f"fk_{i}", [KEY_CLOSE, s], lit)
                v_exp, v_rules = text_until(f"fv_{i}", [VAL_CLOSE, s], lit)
                rules.append(f"free_{i}: {lit(KEY_OPEN)} {k_exp} {lit(VAL_OPEN)} {v_exp}")
                rules += k_rules + v_rules
            rules.append(f"call_{i}: {head} {' '.join(parts)} {lit(CLOSE)}".replace("  ", " "))
        return "\n".join(rules) + "\n"

    def _value(self, rid: str, tool: Tool, key: str, pre: str, lit: Literal) -> list[str]:
        close = [VAL_CLOSE, self.sep]
        schema = arg_schema(tool, key)
        if tool.is_string(key):
            exp, rules = text_until(rid, close, lit, schema)
            return [f"{rid}: {pre} {exp}"] + rules
        return [f"{rid}: {pre} %json{compact_schema(schema)} " + " ".join(lit(c) for c in close if c)]
