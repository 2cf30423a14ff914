"""DeepSeek's tool calls: the JSON format of V3.1 / V3.2-Exp and the DSML format of V3.2 and V4.

    deepseekv31:
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
        ^block open         ^call open          ^name      ^sep       ^arguments (JSON) ^call close  ^block close
    deepseekv32 (block "function_calls") / deepseekv4 (block "tool_calls"):
        <｜DSML｜function_calls>
        <｜DSML｜invoke name="get_weather">
        <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
        <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜function_calls>
"""

from __future__ import annotations

import json
import re

from dhisparse.server.tools.formats import (Literal, PartialCall, ToolFormat, _calls_rule, _keys, compact_schema,
                                            arg_schema, held_back, json_value, kv_json, text_until)
from dhisparse.server.tools.spec import Tool

V31_BLOCK, V31_BLOCK_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
V31_CALL, V31_SEP, V31_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DSML = "｜DSML｜"
INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">')
PARAM = re.compile(r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">')
INVOKE_END, PARAM_END = f"</{DSML}invoke>", f"</{DSML}parameter>"


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _skip_ws(text: str, q: int) -> int:
    return len(text) - len(text[q:].lstrip())


class DeepSeekJsonFormat(ToolFormat):
    """deepseekv31: arguments are the JSON text between the separator and the call's end."""

    name, start = "deepseekv31", V31_BLOCK

    def scan_calls(self, text, i, tools, final):
        calls: list[PartialCall] = []
        pos = i + len(V31_BLOCK)
        while True:
            pos = _skip_ws(text, pos)
            if text.startswith(V31_BLOCK_END, pos):
                return calls, pos + len(V31_BLOCK_END)
            if not text.startswith(V31_CALL, pos):
                return calls, (len(text) if final else None)
            sep = text.find(V31_SEP, pos)
            if sep < 0:
                return calls, (len(text) if final else None)
            name = text[pos + len(V31_CALL):sep].strip()
            a = sep + len(V31_SEP)
            end = text.find(V31_CALL_END, a)
            if end < 0:
                raw = text[a:] if final else text[a:len(text) - held_back(text, V31_CALL_END)]
                calls.append(PartialCall(name, raw.strip(), False))
                return calls, (len(text) if final else None)
            calls.append(PartialCall(name, text[a:end].strip(), True))
            pos = end + len(V31_CALL_END)

    def render_calls(self, calls):
        body = "".join(f"{V31_CALL}{n}{V31_SEP}{_compact(a)}{V31_CALL_END}" for n, a in calls)
        return f"{V31_BLOCK}{body}{V31_BLOCK_END}"

    def lark(self, tools: list[Tool], many: bool, lit: Literal) -> str:
        rules = _calls_rule([f"call_{i}" for i in range(len(tools))], many, "", lit)
        rules[0] = rules[0].replace("start:", "calls:")
        rules.insert(0, f"start: {lit(V31_BLOCK)} calls {lit(V31_BLOCK_END)}")
        for i, t in enumerate(tools):
            params = t.parameters or {"type": "object"}
            rules.append(f"call_{i}: {lit(V31_CALL)} {lit(t.name)} {lit(V31_SEP)} %json{compact_schema(params)} "
                         f"{lit(V31_CALL_END)}")
        return "\n".join(rules) + "\n"


class DsmlFormat(ToolFormat):
    """deepseekv32 / deepseekv4: `block` names the wrapper ("function_calls" or "tool_calls")."""

    def __init__(self, name: str, block: str) -> None:
        self.name = name
        self.start, self.end = f"<{DSML}{block}>", f"</{DSML}{block}>"

    def scan_calls(self, text, i, tools, final):
        calls: list[PartialCall] = []
        pos = i + len(self.start)
        while True:
            pos = _skip_ws(text, pos)
            if text.startswith(self.end, pos):
                return calls, pos + len(self.end)
            m = INVOKE.match(text, pos)
            if m is None:
                return calls, (len(text) if final else None)
            call, pos = self._invoke(text, m, final)
            calls.append(call)
            if not call.closed:
                return calls, (len(text) if final else None)

    @staticmethod
    def _invoke(text: str, m: re.Match, final: bool) -> tuple[PartialCall, int]:
        pairs: list[tuple[str, object]] = []
        q = m.end()
        while True:
            q = _skip_ws(text, q)
            if text.startswith(INVOKE_END, q):
                return PartialCall(m.group(1), kv_json(pairs, True), True), q + len(INVOKE_END)
            p = PARAM.match(text, q)
            end = text.find(PARAM_END, p.end()) if p else -1
            if end < 0:
                return PartialCall(m.group(1), kv_json(pairs, False), False), q
            raw = text[p.end():end]
            pairs.append((p.group(1), raw if p.group(2) == "true" else json_value(raw.strip())))
            q = end + len(PARAM_END)

    def render_calls(self, calls):
        out = [self.start]
        for name, args in calls:
            out.append(f'<{DSML}invoke name="{name}">')
            for k, v in args.items():
                s = isinstance(v, str)
                out.append(f'<{DSML}parameter name="{k}" string="{"true" if s else "false"}">'
                           f'{v if s else _compact(v)}{PARAM_END}')
            out.append(INVOKE_END)
        out.append(self.end)
        return "\n".join(out)

    def lark(self, tools: list[Tool], many: bool, lit: Literal) -> str:
        # every line ends with its newline, so no literal starts with another's ("\n" vs "\n</...>"):
        # llguidance's lexer does not backtrack between lexemes
        rules = _calls_rule([f"call_{i}" for i in range(len(tools))], many, "", lit)
        rules[0] = rules[0].replace("start:", "calls:")
        rules.insert(0, f"start: {lit(self.start + chr(10))} calls {lit(self.end)}")
        for i, t in enumerate(tools):
            parts = []
            for j, (key, required) in enumerate(_keys(t)):
                rid = f"a_{i}_{j}"
                parts.append(rid if required else f"{rid}?")
                rules += self._param(rid, t, key, lit)
            body = " ".join(parts)
            rules.append(f'call_{i}: {lit(f"<{DSML}invoke name=" + json.dumps(t.name) + ">" + chr(10))} {body} '
                         f"{lit(INVOKE_END + chr(10))}".replace("  ", " "))
        return "\n".join(rules) + "\n"

    @staticmethod
    def _param(rid: str, tool: Tool, key: str, lit: Literal) -> list[str]:
        head = f'<{DSML}parameter name={json.dumps(key)} string='
        schema = arg_schema(tool, key)
        if tool.is_string(key):
            exp, rules = text_until(rid, [PARAM_END, "\n"], lit, schema)
            return [f'{rid}: {lit(head + chr(34) + "true" + chr(34) + ">")} {exp}'] + rules
        return [f'{rid}: {lit(head + chr(34) + "false" + chr(34) + ">")} %json{compact_schema(schema)} '
                f"{lit(PARAM_END + chr(10))}"]
