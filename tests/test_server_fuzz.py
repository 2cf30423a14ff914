"""Issue 24: schema-driven fuzzing of every JSON route. Bodies are drawn with hypothesis from the
request schemas the server itself publishes in /openapi.json (each field: a value of its schema,
near its bounds, or any JSON at all; sometimes not an object, broken JSON, huge numbers, deep
nesting), and every answer must be: not a 5xx, in time (client timeout), a JSON error with all of
message / type / param / code for a 4xx (param null only when no field is at fault: malformed
JSON), a whole response or a whole SSE stream for a 2xx. Afterwards the server must answer a fixed
greedy prompt exactly as before. Derandomized, no example database: the same examples every run."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.server import ServerConfig, ServerThread

TIMEOUT_S = 60  # no single request may take longer: a hang fails the test
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
GREEDY = {"model": "tiny", "prompt": "The fixed prompt", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatRequest",
          "/tokenize": "TokenizeRequest", "/v1/dhisparse/prefix": "PrefixRequest"}
VALID = {"/v1/completions": {"prompt": "fuzz", "max_tokens": 3},  # bodies the mutations start from
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 3},
         "/tokenize": {"prompt": "fuzz"}, "/v1/dhisparse/prefix": {"prompt": "a fuzzed prefix"}}


class Raw:
    """JSON text inserted verbatim (what `json.dumps` cannot write: 5,000-digit numbers, NaN, ...)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''})"


def to_json(v) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(to_json(x) for x in v) + "]"
    return json.dumps(v)


RAW_NUMBERS = ["9" * 5000, "-" + "9" * 4400, "1e999", "-1e999", "NaN", "Infinity", "-0", "1.0e-400", "2e308",
               str(2**64), str(2**63), str(-2**63 - 1), "0.5", "1E2"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 10),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                    st.sampled_from([Raw(t) for t in RAW_NUMBERS]),
                    st.sampled_from([Raw("[" * n + "]" * n) for n in (150, 250, 5000)]))
any_json = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=12)


def small_ints(lo: int | None, hi: int | None):
    """Integers of a schema range, mostly small (cheap requests), with the bounds and one past them."""
    lo_, hi_ = -(2**70) if lo is None else lo, 2**70 if hi is None else hi
    edges = [x for x in (lo, hi) if x is not None] + [x + d for x, d in ((lo, -1), (hi, 1)) if x is not None]
    return st.one_of(st.integers(max(lo_, -3), min(hi_, 12)), st.sampled_from(edges or [0]), st.integers(lo_, hi_))


def from_schema(schema: dict, defs: dict, depth: int = 0):
    """Values of a JSON schema (the subset pydantic writes: $ref, anyOf, enum, type, bounds, properties)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema.get("type")
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        return small_ints(schema.get("minimum"), schema.get("maximum"))
    if t == "number":
        return st.one_of(st.floats(-2, 3, allow_nan=False), st.floats(allow_nan=False, allow_infinity=False),
                         st.sampled_from([0, 1, 0.0, 1e-39, 5e-324, 1e308]))
    if t == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        short = st.text(min_size=lo, max_size=min(hi or 16, 16))
        edges = [st.text(min_size=n, max_size=n, alphabet="ab\u00e9\u4e00") for n in (hi, (hi or 0) + 1) if hi]
        return st.one_of(short, *edges)
    if t == "array":
        hi = schema.get("maxItems")
        items = from_schema(schema.get("items", {}), defs, depth + 1)
        lists = [st.lists(items, max_size=min(hi or 4, 4))]
        if hi:
            lists.append(st.lists(items, min_size=hi + 1, max_size=hi + 1))
        return st.one_of(lists)
    if t == "object" or "properties" in schema:
        return body_of(schema, defs, depth + 1)
    return any_json


def body_of(schema: dict, defs: dict, depth: int = 0):
    """Objects of a schema: required fields mostly present, optional ones sometimes; each field a
    value of its schema or, at times, anything; now and then an unknown extra key."""
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fields = {name: from_schema(sub, defs, depth) for name, sub in props.items()}
    required_keys = st.lists(st.sampled_from(sorted(required)), unique=True) if required else st.just([])
    optional_keys = st.lists(st.sampled_from(sorted(set(props) - required)), unique=True, max_size=6) \
        if set(props) - required else st.just([])

    @st.composite
    def build(draw):
        keys = set(draw(optional_keys))
        keys |= required if draw(st.integers(0, 9)) else set(draw(required_keys))
        obj = {k: draw(any_json if depth < 3 and draw(st.integers(0, 7)) == 0 else fields[k]) for k in sorted(keys)}
        if draw(st.integers(0, 9)) == 0:
            obj[draw(st.text(min_size=1, max_size=8))] = draw(any_json)
        return obj

    return build()


def mutated(valid: dict, schema: dict, defs: dict):
    """A valid body with one to three fields replaced by values of their schema (mostly still valid,
    so the generation paths run too, streamed or not)."""
    props = schema["properties"]

    @st.composite
    def build(draw):
        obj = dict(valid)
        if "stream" in props and draw(st.integers(0, 2)) == 0:
            obj["stream"] = True
        for name in draw(st.lists(st.sampled_from(sorted(props)), min_size=1, max_size=3, unique=True)):
            obj[name] = draw(from_schema(props[name], defs))
        return obj

    return build()


@pytest.fixture(scope="module")
def server():
    engine = Engine(EngineConfig(device="cpu", max_model_len=256, kv_pool_bytes=32 << 20))
    with ServerThread(engine, ServerConfig(default_max_tokens=4, drain_timeout_s=2)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def spec(client):
    return client.get("/openapi.json").json()


@pytest.fixture(scope="module")
def baseline(client):
    r = client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def check(client: httpx.Client, path: str, raw: bytes, schema: dict, streamed: bool) -> None:
    """Send one body; assert the answer is well formed (module docstring)."""
    headers = {"content-type": "application/json"}
    if streamed:
        with client.stream("POST", path, content=raw, headers=headers) as r:
            if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                lines = [ln for ln in r.iter_lines() if ln]
                assert lines and lines[-1] == "data: [DONE]", lines[-3:]
                for ln in lines[:-1]:
                    assert ln.startswith("data: "), ln
                    json.loads(ln[6:])
                return
            r.read()
    else:
        r = client.post(path, content=raw, headers=headers)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    if r.status_code >= 400:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and len(err["message"]) < 400, err
        if err["param"] is None:
            assert err["code"] == "invalid_json", err  # no single field at fault: the body is not a JSON object
        else:
            assert err["param"] in schema["properties"] or err["code"] == "unknown_parameter", err
    else:
        assert r.status_code == 200
        if path in ("/v1/completions", "/v1/chat/completions"):
            assert body["choices"] and body["usage"]["completion_tokens"] <= 256 * len(body["choices"])
        elif path == "/tokenize":
            assert body["count"] == len(body["tokens"])
        else:
            assert isinstance(body["prefix_tokens"], int)


def route_test(path: str, examples: int):
    @settings(max_examples=examples, **SETTINGS)
    @given(data=st.data())
    def run(client, spec, baseline, data):
        schemas = spec["components"]["schemas"]
        schema = schemas[ROUTES[path]]
        body = data.draw(st.one_of(body_of(schema, schemas), mutated(VALID[path], schema, schemas)), label="body")
        raw = to_json(body).encode()
        streamed = isinstance(body, dict) and body.get("stream") is True
        check(client, path, raw, schema, streamed)

    return run


# CI-sized counts (about half the examples); the `slow` twins draw the full counts
test_fuzz_completions = route_test("/v1/completions", 70)
test_fuzz_chat = route_test("/v1/chat/completions", 55)
test_fuzz_tokenize = route_test("/tokenize", 25)
test_fuzz_prefix = route_test("/v1/dhisparse/prefix", 25)
test_fuzz_completions_full = pytest.mark.slow(route_test("/v1/completions", 140))
test_fuzz_chat_full = pytest.mark.slow(route_test("/v1/chat/completions", 110))


@settings(max_examples=60, **SETTINGS)
@given(path=st.sampled_from(sorted(ROUTES)),
       raw=st.one_of(st.binary(max_size=64), any_json.map(lambda v: to_json(v).encode()),
                     st.builds(lambda v, n: to_json(v).encode()[:n], any_json, st.integers(0, 40))))
def test_fuzz_not_a_body(client, spec, baseline, path, raw):
    """Bytes that are not a request object at all: garbage, JSON of any other shape, truncated JSON."""
    check(client, path, raw, spec["components"]["schemas"][ROUTES[path]], streamed=False)


def test_server_answers_as_before_after_fuzzing(server, client, baseline):
    r = client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline
    assert client.get("/health").json()["status"] == "ok"
    assert server.state.worker.alive
