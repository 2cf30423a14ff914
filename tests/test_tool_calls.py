"""Tool calls through the HTTP API with the official `openai` client (issue 28 item 1).

On the built-in model (byte tokenizer, default template, GLM-5's glm47 format) under `hisparse`
and `adaptive+spec`: tool_choice "required" / a named function give calls whose arguments validate
against their schemas, streamed and not, the stream's deltas adding up to the whole message;
"none" hides the tools; "auto" reads calls out of free output; the history's calls and tool
answers reach the template; bad tool fields are 400s naming them. On a tiny GLM-5 checkpoint
(`glm_moe_dsa`, a BPE tokenizer whose markers are special tokens, a chat template written to
GLM-5's format): the template renders tools and the history as GLM-5's does, and a required call
comes back parsed.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.models.tokenizer import ByteTokenizer
from dhisparse.server import ServerConfig, ServerThread
from dhisparse.server.chat import chat_setup
from dhisparse.server.protocol import ChatRequest
from dhisparse.server.tools import FORMATS
from client_import import openai_client

openai = openai_client()

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"type": "string", "enum": ["c", "f"]}, "hourly": {"type": "boolean"}}, "required": ["city", "days"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": SCHEMA}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOW]
MSGS = [{"role": "user", "content": "weather in Paris for 3 days?"}]
BASE = dict(device="cpu", max_model_len=1024, kv_pool_bytes=16 << 20, hot_cache_rows=16)


def client_for(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=["hisparse", "adaptive+spec"])
def client(request):
    extra = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4) if "spec" in request.param else {}
    eng = Engine(EngineConfig(preset=request.param, **extra, **BASE))
    with ServerThread(eng, ServerConfig(drain_timeout_s=5)) as srv:
        yield client_for(srv)


def check_calls(calls, names=("get_weather", "now")):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMA if c.function.name == "get_weather" else {"type": "object", "maxProperties": 0})


def joined(parts) -> tuple[str, dict]:
    """A stream's content and calls ({index: [id, name, arguments]}) from its deltas."""
    content, calls = "", {}
    for p in parts:
        for ch in p.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                e = calls.setdefault(d.index, [None, None, ""])
                if d.id:
                    e[0], e[1] = d.id, d.function.name
                e[2] += d.function.arguments or ""
    return content, calls


def test_required_calls_validate_streamed_and_not(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       max_tokens=300, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    check_calls(ch.message.tool_calls)
    parts = list(client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                                max_tokens=300, temperature=0, stream=True))
    content, calls = joined(parts)
    assert [(c[1], c[2]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]  # greedy: the same calls
    assert (content or None) == ch.message.content
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "tool_calls"


def test_sampled_named_and_single_calls(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required", n=3,
                                       temperature=1.0, seed=11, max_tokens=300, parallel_tool_calls=False)
    for ch in r.choices:  # sampled, one call each (with parallel calls a random model may call until the length)
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls)
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=300, temperature=1.0,
                                       seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    check_calls(calls)
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_none_hides_the_tools_and_auto_reads_calls_from_free_output(client):
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0)
    none = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=4,
                                          temperature=0)
    auto = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    call = FORMATS["glm47"].render_calls([("get_weather", {"city": "Oslo", "days": 2})])
    forced = {"type": "grammar", "grammar": "start: " + json.dumps("Sure. " + call)}  # free output that is a call
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
                                           stream=stream, extra_body={"response_format": forced})
        if stream:
            content, calls = joined(list(r))
            assert content == "Sure." and [(c[1], c[2]) for c in calls.values()] == \
                [("get_weather", '{"city": "Oslo", "days": 2}')]
        else:
            m = r.choices[0].message
            assert m.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
            assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 2}


def test_a_conversation_with_calls_and_answers(client):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3, temperature=0)
    assert r.choices[0].message.role == "assistant"
    setup = chat_setup(ChatRequest.model_validate({"messages": history, "tools": TOOLS}), FORMATS["glm47"], True)
    text = setup.render(ByteTokenizer())
    assert '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>' \
           '<arg_value>3</arg_value></tool_call>' in text
    assert '<|tool|>\n{"temp": 21}' in text and '"name": "get_weather"' in text


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
def test_bad_tool_fields_are_400s_naming_them(client, body, param):
    body = dict(body)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=body.pop("messages", MSGS), max_tokens=2,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_completions_has_no_tools(client):
    r = httpx.post(str(client.base_url) + "completions", json={"prompt": "x", "tools": TOOLS, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# -- a tiny GLM-5 checkpoint with GLM-5's chat format ---------------------------------------------
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "<tool_response>", "</tool_response>"]
# Written here to GLM-5's format (tools block, call syntax, observation turns; thinking closed in
# past assistant turns and opened by the generation prompt), checked against a rendering below.
GLM5_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|></think>{{ m.content }}
{%- for tc in m.tool_calls or [] -%}<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() -%}<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>{%- endfor -%}
</tool_call>{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}<tool_response>{{ m.content }}</tool_response>
{%- elif m.role == 'system' -%}<|system|>{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}{%- endif -%}"""


@pytest.fixture(scope="module")
def glm5_folder(tmp_path_factory):
    from hf_fixtures import glm_config, save_hf_checkpoint
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = save_hf_checkpoint(glm_config(vocab_size=512, max_position_embeddings=2048),
                                tmp_path_factory.mktemp("glm5"))
    raw = Raw(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    corpus = [GLM5_TEMPLATE, json.dumps(TOOLS), "weather in Paris for 3 days? get_weather city days unit"] * 20
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=GLM_SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(GLM5_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    ids = [raw.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


def test_glm5_template_renders_like_glm5(glm5_folder):
    """The rendering of a public GLM-5 example (tools, a call, its answer; thinking off in history)."""
    from dhisparse.models.tokenizer import HFTokenizer

    tok = HFTokenizer(glm5_folder)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
        "type": "object", "required": ["location"], "properties": {"location": {"type": "string"}}}}}
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {
                "name": "get_weather", "arguments": {"location": "Tokyo", "unit": "celsius"}}}]},
            {"role": "tool", "content": '{"temperature":22}'}]
    sig = json.dumps(tool)
    assert tok.apply_chat_template(msgs, tools=[tool]) == (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + sig + "\n</tools>\n\n"
        "For each function call, output the function name and arguments within the following XML format:\n"
        "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>"
        "{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|user|>Weather?<|assistant|></think>"
        "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Tokyo</arg_value><arg_key>unit</arg_key>"
        "<arg_value>celsius</arg_value></tool_call><|observation|><tool_response>{\"temperature\":22}</tool_response>"
        "<|assistant|><think>")


def test_glm5_checkpoint_serves_tool_calls(glm5_folder):
    eng = Engine(EngineConfig(model=str(glm5_folder), preset="hisparse", **BASE))
    with ServerThread(eng, ServerConfig(drain_timeout_s=5)) as srv:
        client = client_for(srv)
        name = client.models.list().data[0].id
        kw = dict(model=name, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls)
        _, calls = joined(list(client.chat.completions.create(stream=True, **kw)))
        assert [(c[1], c[2]) for _, c in sorted(calls.items())] == \
            [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
