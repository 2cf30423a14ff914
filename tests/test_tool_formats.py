"""Tool-call formats (server/tools): reading a model's calls (whole and streamed, the deltas
concatenating to the whole message), writing them, and the grammar of tool_choice "required" / a
named function, for every format; special-token markers; the format chosen per checkpoint.
Mutations at the end show the stream-consistency and grammar checks can fail."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.engine.grammar import Grammars
from dhisparse.models.tokenizer import ByteTokenizer, HFTokenizer
from dhisparse.server.tools import (FORMATS, ToolCallParser, ToolChoice, choose_format, parse_tool_choice, parse_tools,
                                    tool_grammar)
from dhisparse.server.tools import formats as F
from dhisparse.server.protocol import ApiError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                     "unit": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = parse_tools([WEATHER, NOW])
CALLS = [("get_weather", {"city": "Pa<ris </x>", "days": 3, "unit": "c"}), ("now", {})]
EXPECTED = [("get_weather", {"city": "Pa<ris </x>", "days": 3, "unit": "c"}), ("now", {})]


def stream(parser: ToolCallParser, text: str, cuts) -> tuple[str, dict[int, list]]:
    """Feed `text` cut at `cuts`; -> (content, {call index: [name, arguments]}) from the deltas."""
    content, calls = "", {}
    for k in list(cuts) + [None]:
        c, deltas = parser.feed(text[:k]) if k is not None else parser.finish(text)
        content += c
        for d in deltas:
            entry = calls.setdefault(d.index, [None, ""])
            if d.name is not None:
                assert entry[0] is None and d.id is not None  # the opening delta comes once, first
                entry[0] = d.name
            entry[1] += d.arguments
    return content, calls


def read(fmt, text: str, single: bool = False):
    p = ToolCallParser(fmt, TOOLS, single)
    p.finish(text)
    return p.message()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_written_calls_read_back_whole_and_streamed(name):
    fmt = FORMATS[name]
    text = "Let me check." + fmt.render_calls(CALLS)
    msg = read(fmt, text)
    assert msg.content == "Let me check."
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls]
    assert got == EXPECTED
    assert len({c["id"] for c in msg.tool_calls}) == 2
    content, calls = stream(ToolCallParser(fmt, TOOLS), text, range(1, len(text) + 1))
    assert content == msg.content
    assert [(calls[i][0], calls[i][1]) for i in sorted(calls)] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.lists(st.integers(0, 400), max_size=12),
       st.text(alphabet="ab <>/\n_", max_size=6))
def test_any_cut_of_the_stream_gives_the_same_message(name, cuts, prefix):
    """Hypothesis over where the engine's text deltas fall and what content comes first."""
    fmt = FORMATS[name]
    text = prefix + fmt.render_calls(CALLS)
    msg = read(fmt, text)
    content, calls = stream(ToolCallParser(fmt, TOOLS), text, sorted(c for c in cuts if c <= len(text)))
    assert content == (msg.content or "")
    assert [calls[i][1] for i in sorted(calls)] == [c["function"]["arguments"] for c in msg.tool_calls]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_text_without_calls_and_unreadable_markers_stay_content(name):
    fmt = FORMATS[name]
    for text in ["plain answer", "a < b and <tool", fmt.start, "x" + fmt.start[:-1]]:
        msg = read(fmt, text)
        assert msg.content == text and msg.tool_calls == []
        content, calls = stream(ToolCallParser(fmt, TOOLS), text, range(1, len(text)))
        assert content == text and not calls


def test_a_call_cut_short_keeps_its_stable_arguments():
    fmt = FORMATS["glm47"]
    text = fmt.render_calls(CALLS[:1])
    cut = text[: text.index("<arg_key>days")]
    msg = read(fmt, cut)
    assert msg.tool_calls[0]["function"]["arguments"] == '{"city": "Pa<ris </x>"'  # unclosed: length


def test_glm_values_follow_the_schema_and_dsml_its_string_attribute():
    glm = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value>" \
          "<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>x</arg_key><arg_value>[1]</arg_value></tool_call>"
    args = json.loads(read(FORMATS["glm47"], glm).tool_calls[0]["function"]["arguments"])
    assert args == {"city": "42", "days": 2, "x": [1]}  # city is a string in the schema: raw
    dsml = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">7</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">7</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    assert json.loads(read(FORMATS["deepseekv32"], dsml).tool_calls[0]["function"]["arguments"]) == {"city": "7", "days": 7}


def test_single_keeps_the_first_call_and_trailing_text_is_content():
    fmt = FORMATS["glm47"]
    msg = read(fmt, fmt.render_calls(CALLS) + " done", single=True)
    assert [c["function"]["name"] for c in msg.tool_calls] == ["get_weather"] and msg.content == " done"


def byte_grammars():
    return Grammars(ByteTokenizer(), 320)


def accepts(G: Grammars, grammar: str, ids: list[int]) -> bool:
    m = G.matcher(grammar).m
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_required_grammar_takes_exactly_the_formats_calls(name):
    fmt, G, tok = FORMATS[name], byte_grammars(), ByteTokenizer()
    many = tool_grammar(fmt, TOOLS, ToolChoice("required"), True, G.literal)
    one = tool_grammar(fmt, TOOLS, ToolChoice("required"), False, G.literal)
    named = tool_grammar(fmt, TOOLS, ToolChoice("function", "now"), True, G.literal)
    for g in (many, one, named):
        G.validate(g)
    both, first = fmt.render_calls(CALLS), fmt.render_calls(CALLS[:1])
    assert accepts(G, many, tok.encode(both)) and accepts(G, many, tok.encode(first))
    assert accepts(G, one, tok.encode(first)) and not accepts(G, one, tok.encode(both))
    assert accepts(G, named, tok.encode(fmt.render_calls([("now", {})])))
    assert not accepts(G, named, tok.encode(first))
    bad = [("get_weather", {"city": "x", "days": "three"}), ("get_weather", {"city": "x"}),  # type, required
           ("get_weather", {"city": "x", "days": 1, "unit": "k"}), ("nope", {})]  # enum, unknown function
    for call in bad:
        assert not accepts(G, many, tok.encode(fmt.render_calls([call]))), call


def test_special_token_markers_are_named_as_tokens(tmp_path):
    """A tokenizer whose <tool_call> / </arg_value> are special tokens: the grammar names them as
    tokens (a quoted string would make the model spell them byte by byte), and decoding with
    skip_special_tokens=False keeps them for the parser."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
    raw = Raw(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.train_from_iterator(["get_weather city Paris days now"] * 10, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = HFTokenizer(tmp_path)
    G = Grammars(tok, 400)
    assert G.literal("<tool_call>") == "<tool_call>" and G.literal("get_weather") == '"get_weather"'
    fmt = FORMATS["glm47"]
    g = tool_grammar(fmt, TOOLS, ToolChoice("required"), True, G.literal)
    G.validate(g)
    text = fmt.render_calls(CALLS[:1])
    ids = tok.encode(text)
    assert accepts(G, g, ids)
    assert tok.decode(ids, skip_special=False) == text and "<tool_call>" not in tok.decode(ids)


def test_choose_format_by_flag_template_and_architecture():
    assert choose_format(None, "glm_moe_dsa", None).name == "glm47"
    assert choose_format("auto", "deepseek_v32", None).name == "deepseekv32"
    assert choose_format(None, "deepseek_v4", None).name == "deepseekv4"
    assert choose_format(None, "glm_moe_dsa", "{{ '<｜tool▁sep｜>' }}").name == "deepseekv31"
    assert choose_format(None, "deepseek_v32", "x\\n<arg_key>{{ k }}").name == "glm45"
    assert choose_format("glm45", "deepseek_v32", None).name == "glm45"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        choose_format("hermes", "glm_moe_dsa", None)


def test_bad_tools_and_tool_choice_name_the_field():
    cases = [([{"type": "function"}], None, "tools"), ([{"type": "code_interpreter"}], None, "tools"),
             ([{"type": "function", "function": {"name": "a b"}}], None, "tools"),
             ([WEATHER, WEATHER], None, "tools"),
             ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "tools"),
             ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
             ([WEATHER], "sometimes", "tool_choice"), (None, "required", "tool_choice")]
    for tools, choice, param in cases:
        with pytest.raises(ApiError) as e:
            parse_tool_choice(choice, parse_tools(tools))
        assert e.value.param == param, (tools, choice)
    assert parse_tool_choice(None, ()).mode == "none" and parse_tool_choice(None, TOOLS).mode == "auto"


def test_mutations_are_caught(monkeypatch):
    """A parser that does not hold back a possible marker start leaks it into the streamed content,
    and a grammar that drops the required keys accepts a call without them: both checks fail."""
    fmt = FORMATS["glm47"]
    text = "ok" + fmt.render_calls(CALLS)
    monkeypatch.setattr(F, "held_back", lambda text, marker: 0)
    content, _ = stream(ToolCallParser(fmt, TOOLS), text, range(1, len(text)))
    assert content != read(fmt, text).content
    monkeypatch.undo()
    G = byte_grammars()
    monkeypatch.setattr(F, "_keys", lambda tool: [(k, False) for k in (tool.parameters.get("properties") or {})])
    import dhisparse.server.tools.glm as glm

    monkeypatch.setattr(glm, "_keys", F._keys)
    g = tool_grammar(fmt, TOOLS, ToolChoice("required"), True, G.literal)
    assert accepts(G, g, ByteTokenizer().encode(fmt.render_calls([("get_weather", {"city": "x"})])))
