"""Structured output (response_format json_object / json_schema via llguidance): every completion
validates against its schema under `hisparse` and `adaptive+spec`, greedy and sampled; speculative
rounds whose drafts leave the grammar are rejected and the matcher rolls back (token-identical to
non-speculative constrained decoding); the official `openai` client, streamed and not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.grammar import compile_response_format
from dhisparse.server import ServerConfig, ServerThread
from client_import import openai_client

openai = openai_client()

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(20 + 9 * i)] for i in range(3)] + [[5, 6, 7, 8, 9] * 6]
BASE = dict(device="cpu", max_model_len=256, kv_pool_bytes=16 << 20, hot_cache_rows=16)


def run_all(eng: Engine, prompts, params) -> list:
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    return [final[i] for i in ids]


def params_for(grammar: str) -> list[SamplingParams]:
    return ([SamplingParams(max_tokens=160, grammar=grammar)]
            + [SamplingParams(max_tokens=160, temperature=1.0, seed=s, grammar=grammar) for s in range(1, len(PROMPTS))])


@pytest.fixture(scope="module")
def grammar() -> str:
    return compile_response_format(FORMAT)


@pytest.fixture(scope="module")
def reference(grammar):
    """Constrained outputs without speculation (hisparse), and the unconstrained greedy ones."""
    eng = Engine(EngineConfig(preset="hisparse", **BASE))
    constrained = run_all(eng, PROMPTS, params_for(grammar))
    free = run_all(eng, PROMPTS, [SamplingParams(max_tokens=40, ignore_eos=True)] * len(PROMPTS))
    return constrained, {tuple(p): o.token_ids for p, o in zip(PROMPTS, free)}


def test_every_completion_validates_under_hisparse(reference):
    for out in reference[0]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.parametrize("algorithm", ["ngram", "oracle"])
def test_adaptive_spec_is_valid_and_greedy_identical(grammar, reference, algorithm):
    """ngram: the n-gram drafter; oracle: drafts from the *unconstrained* greedy output, so most
    drafts leave the grammar and must be rejected, the matcher rolling them back."""
    extra = {"speculative_oracle_tokens_per_round": 3.0} if algorithm == "oracle" else {}
    eng = Engine(EngineConfig(preset="adaptive+spec", speculative_algorithm=algorithm, speculative_num_draft_tokens=4,
                              **extra, **BASE), oracle_reference=reference[1])
    outs = run_all(eng, PROMPTS, params_for(grammar))
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert outs[0].token_ids == reference[0][0].token_ids  # greedy: token-identical to non-speculative
    st = eng.stats().as_dict()
    assert st["spec_rounds"] > 0
    if algorithm == "oracle":
        assert st["spec_accept_pos1"] < 1.0  # some drafts outside the grammar were rejected


def test_json_object_and_a_bad_schema(grammar):
    eng = Engine(EngineConfig(preset="hisparse", **BASE))
    g = compile_response_format({"type": "json_object"})
    outs = run_all(eng, PROMPTS[:2], [SamplingParams(max_tokens=200, grammar=g, seed=4, temperature=0.7)] * 2)
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    with pytest.raises(ValueError, match="response_format"):
        eng.grammars.validate(compile_response_format({"type": "json_schema",
                                                       "json_schema": {"schema": {"type": "bogus"}}}))


@pytest.fixture(scope="module")
def client():
    eng = Engine(EngineConfig(preset="adaptive+spec", speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                              **BASE))
    with ServerThread(eng, ServerConfig(drain_timeout_s=5)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_json_schema_streamed_and_not(client):
    msgs = [{"role": "user", "content": "a person"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, response_format=FORMAT, n=3, temperature=1.0,
                                       seed=9, max_tokens=160)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, response_format=FORMAT, stream=True,
                                                temperature=0, max_tokens=160))
    jsonschema.validate(json.loads("".join(p.choices[0].delta.content or "" for p in parts if p.choices)), SCHEMA)
    c = client.completions.create(model="tiny", prompt="json:", max_tokens=160, temperature=0,
                                  extra_body={"response_format": FORMAT})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert e.value.body["param"] == "response_format"


@pytest.mark.parametrize("preset", ["resident", "adaptive", "resident+spec", "adaptive+spec"])
def test_every_preset_with_its_default_drafter(grammar, reference, preset):
    eng = Engine(EngineConfig(preset=preset, **BASE))
    outs = run_all(eng, PROMPTS[:2], params_for(grammar)[:2])
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert outs[0].token_ids == reference[0][0].token_ids


def test_regex_and_grammar_extras(reference):
    import re

    eng = Engine(EngineConfig(preset="hisparse", **BASE))
    rx = compile_response_format({"type": "regex", "regex": "[a-c]{3}-[0-9]{2}"})
    lark = compile_response_format({"type": "grammar", "grammar": 'start: "yes" | "no"'})
    outs = run_all(eng, PROMPTS[:2], [SamplingParams(max_tokens=20, temperature=1.0, seed=1, grammar=rx),
                                      SamplingParams(max_tokens=20, grammar=lark)])
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", outs[0].text) and outs[1].text in ("yes", "no")
