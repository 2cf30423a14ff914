"""The OpenAI-compatible server over real HTTP (uvicorn in a background thread, 127.0.0.1, free
port) with the built-in tiny model on CPU, driven by the official `openai` client and httpx."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_sampling_api import capture_logits
from client_import import openai_client

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.server import ServerConfig, ServerThread

openai = openai_client()

MAX_MODEL_LEN = 512
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, kv_pool_bytes=64 << 20))


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine, ServerConfig(drain_timeout_s=5)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def pages_used(server) -> float:
    """KV pages in use, read from the Prometheus endpoint."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("dhisparse_kv_pages_used{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("dhisparse_kv_pages_used missing from /metrics")


def wait_pages(server, target: float, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    used = pages_used(server)
    while used != target and time.monotonic() < deadline:
        time.sleep(0.05)
        used = pages_used(server)
    return used


def post(server, path: str, body: bytes | dict) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.url + path, json=body, timeout=30)
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def test_models_health_and_completion(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = client.completions.create(model="tiny", prompt="Hello world", **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len("Hello world")
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_completion_uses_template(server, client, engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(msgs)))
    assert r.usage.completion_tokens == 12


def test_streaming_concatenates_to_non_streamed_text(client):
    full = client.completions.create(model="tiny", prompt="Stream me", **GREEDY).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt="Stream me", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    msgs = [{"role": "user", "content": "Stream chat"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, **GREEDY).choices[0].message.content
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, stream=True, **GREEDY))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat


def test_stop_string_and_seed(client):
    text = client.completions.create(model="tiny", prompt="abc", **GREEDY).choices[0].text
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isalnum()), None)
    if stop is None:
        pytest.skip("greedy text of the tiny model has no ASCII letter to stop on")
    r = client.completions.create(model="tiny", prompt="abc", stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop, 1)]
    kw = dict(model="tiny", prompt="abc", temperature=1.0, max_tokens=12, seed=7, extra_body={"top_k": 50})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_concurrent_requests(client):
    results: dict[int, object] = {}

    def one(i: int) -> None:
        results[i] = client.completions.create(model="tiny", prompt=f"request {i}", **GREEDY)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(6))
    assert all(r.usage.completion_tokens == 12 for r in results.values())


def test_cancel_mid_stream_frees_pages(server, client):
    base = wait_pages(server, 0.0)
    assert base == 0.0
    stream = client.completions.create(model="tiny", prompt="cancel me", stream=True, temperature=0,
                                       max_tokens=400, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got >= 3:
            break
    assert pages_used(server) > base
    stream.close()
    assert wait_pages(server, base) == base


def test_disconnect_of_non_streamed_request_aborts_it(server, engine):
    before = engine.stats().generated_tokens
    with pytest.raises(httpx.TimeoutException):
        post_timeout = {"model": "tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
        httpx.post(server.url + "/v1/completions", json=post_timeout, timeout=0.5)
    assert wait_pages(server, 0.0) == 0.0
    assert engine.stats().generated_tokens - before < 480  # stopped early, not run to the end


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    ({"model": "gpt-4", "prompt": "x"}, "not served"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "x" * (MAX_MODEL_LEN + 10)}, "max_model_len"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, "not supported"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, "unknown field"),
    ({"model": "tiny"}, "prompt"),
])
def test_bad_requests_are_400_with_message(server, body, needle):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}


def test_bad_requests_through_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="not served"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 600}], stream=True)


def test_metrics_exports_engine_stats_and_histograms(server, engine):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text  # one finished request: the latency histograms have samples
    text = httpx.get(server.url + "/metrics").text
    for name in ("dhisparse_num_requests_running", "dhisparse_num_requests_waiting", "dhisparse_kv_pages_total",
                 "dhisparse_generation_tokens_total", "dhisparse_time_to_first_token_seconds_bucket",
                 "dhisparse_time_per_output_token_seconds_count", "dhisparse_requests_finished_total"):
        assert name in text, name
    for key, value in engine.stats().as_dict().items():
        if isinstance(value, (int, float)):
            assert f"dhisparse_engine_{key}{{" in text, key


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-324])
@pytest.mark.parametrize("stream", [False, True])
def test_tiny_temperature_does_not_kill_the_engine(server, client, temperature, stream):
    """Issue 24 item 1: a denormal temperature used to make multinomial raise on the engine
    thread, which failed every stream and turned /health to 503 until restart."""
    for route in ("completions", "chat"):
        if route == "completions":
            body = {"prompt": "hi", "max_tokens": 4, "temperature": temperature, "stream": stream}
            r = post(server, "/v1/completions", body)
        else:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": temperature, "stream": stream}
            r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="hello", **GREEDY)
    assert out.choices[0].finish_reason == "length"


# -- issue 24 items 4, 5, 7: strict bodies, OpenAI-shaped errors, limits, schemas, metrics ----------------

def error_of(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI-shaped error of a response, checked: JSON, every key present."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


DEEP = b'{"prompt": "x", "logprobs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE_INT = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": True}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 2 ** 70}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("/v1/completions", {"prompt": [2 ** 80]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": 7}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": {"role": "user", "content": "x"}}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": False},
     "max_completion_tokens"),
    ("/tokenize", {"prompt": ["x"]}, "prompt"),
    ("/tokenize", {"prompt": True}, "prompt"),
    ("/v1/dhisparse/prefix", {"prompt": [True, 3]}, "prompt"),
])
def test_strict_types_are_400_naming_the_field(server, path, body, param):
    err = error_of(post(server, path, body))
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw, param", [
    (DEEP, None),  # 100,000-deep nesting: RecursionError (500) today
    (HUGE_INT, "max_tokens"),  # a 5,000-digit integer: ValueError from int() (500) today
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    (b"\xff\xfe\x00", None),
    (b"", None),
    (b"null", None),
    (b'"just a string"', None),
], ids=["deep", "huge_int", "nan", "inf", "not_utf8", "empty", "null", "string"])
def test_malformed_bodies_are_400_never_500(server, raw, param):
    err = error_of(post(server, "/v1/completions", raw))
    assert err["param"] == param, err
    assert len(err["message"]) < 400, err["message"]


def test_error_messages_quote_only_a_short_prefix(server):
    long = "q" * 100_000
    for path, body in [("/v1/completions", {"prompt": "x", "model": long}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": long}),
                       ("/v1/completions", {"prompt": "x", "stop": [long]}),
                       ("/v1/completions", {"prompt": [long, long]}),
                       ("/v1/chat/completions", {"messages": [{"role": long, "content": "x"}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": long}]}]}),
                       ("/tokenize", {"prompt": [long]})]:
        err = error_of(post(server, path, body))
        assert "q" * 65 not in err["message"], (path, err["message"][:200])
        assert len(err["message"]) < 400, (path, len(err["message"]))


def test_stop_strings_are_capped(server):
    ok = {"prompt": "x", "max_tokens": 2, "stop": [chr(0x4e00 + i) * 256 for i in range(16)]}
    assert post(server, "/v1/completions", ok).status_code == 200
    for stop in (["s%d" % i for i in range(17)], ["y" * 257], ["s%d" % i for i in range(100_000)], ""):
        err = error_of(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": stop}))
        assert err["param"] == "stop", err
    err = error_of(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "stop": ["z"] * 17}))
    assert err["param"] == "stop"


def test_fastapi_errors_are_openai_shaped(server):
    err = error_of(httpx.get(server.url + "/v1/nowhere"), 404)
    assert err["param"] is None and err["code"] is not None
    err = error_of(httpx.get(server.url + "/v1/completions"), 405)
    assert err["param"] is None
    err = error_of(httpx.delete(server.url + "/health"), 405)


def test_openapi_describes_every_request_body(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/v1/dhisparse/prefix", "PrefixRequest")]:
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}", ref
        assert model in schemas
    props = schemas["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "stream", "stop", "seed"} <= set(props)
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatRequest"]["required"]


def test_tokenization_runs_off_the_engine_thread(server, engine, monkeypatch):
    """Issue 24 item 4: a 10 MB prompt tokenized on the engine thread froze every other stream."""
    seen: list[tuple[str, str]] = []
    encode, template = engine.encode_prompt, engine.tokenizer.apply_chat_template

    def spy_encode(prompt):
        if isinstance(prompt, str):
            seen.append(("encode", threading.current_thread().name))
        return encode(prompt)

    def spy_template(messages, **kw):
        seen.append(("template", threading.current_thread().name))
        return template(messages, **kw)

    monkeypatch.setattr(engine, "encode_prompt", spy_encode)
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", spy_template)
    assert post(server, "/v1/completions", {"prompt": "off the loop", "max_tokens": 2}).status_code == 200
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2}).status_code == 200
    assert post(server, "/v1/dhisparse/prefix", {"prompt": "a shared prefix"}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN + 10)}).status_code == 400
    assert {k for k, _ in seen} == {"encode", "template"}, seen
    on_engine = [s for s in seen if s[1] == "dhisparse-engine"]
    on_loop = [s for s in seen if s[1] == "dhisparse-uvicorn"]
    assert not on_engine and not on_loop, seen


def test_an_overlong_prompt_is_refused_without_tokenizing_all_of_it(server, engine, monkeypatch):
    """Tokenizing holds the GIL: a 4 MB prompt tokenized whole (on any thread) stopped every
    stream for 0.2 s; a prompt far over max_model_len is refused from a prefix's tokens."""
    lengths: list[int] = []
    encode = engine.tokenizer.encode

    def spy(text):
        lengths.append(len(text))
        return encode(text)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    for path, body in [("/v1/completions", {"prompt": "y" * (3 << 20), "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * (3 << 20)}]})]:
        err = error_of(post(server, path, body))
        assert "max_model_len" in err["message"] and err["param"] in ("prompt", "messages"), err
    assert lengths and max(lengths) < 100_000, lengths
    err = error_of(post(server, "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN + 10)}))
    assert f"prompt has {MAX_MODEL_LEN + 10} tokens" in err["message"]  # near the limit: the exact count


def metric(server, name: str, **labels) -> float:
    """One sample of /metrics (0.0 when absent), matched by name and a subset of labels."""
    total, found = 0.0, False
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total, found = total + float(line.rsplit(" ", 1)[1]), True
    return total if found else float("nan")


def test_metrics_gauges_are_set_and_zeroed_when_idle(server, engine):
    assert post(server, "/v1/completions", {"prompt": "idle soon", "max_tokens": 3}).status_code == 200
    assert wait_pages(server, 0.0) == 0.0
    text = httpx.get(server.url + "/metrics").text
    for name in ("dhisparse_num_requests_running", "dhisparse_num_requests_waiting", "dhisparse_slots",
                 "dhisparse_request_slots_total", "dhisparse_request_slots_used",
                 "dhisparse_device_pages_used", "dhisparse_device_pages_total",
                 "dhisparse_host_pages_used", "dhisparse_host_pages_total", "dhisparse_optional_pages"):
        assert f"\n{name}{{" in text, name
    assert metric(server, "dhisparse_request_slots_total") == engine.config.max_running_requests
    assert metric(server, "dhisparse_device_pages_total") == engine.stats().kv_pages_total
    for name in ("dhisparse_engine_decoding", "dhisparse_num_requests_running", "dhisparse_slots",
                 "dhisparse_request_slots_used", "dhisparse_device_pages_used"):
        assert metric(server, name) == 0.0, name


def test_metrics_count_aborts_by_reason(server, client):
    name = "dhisparse_requests_aborted_total"
    before = metric(server, name, reason="client_disconnect")
    before = 0.0 if before != before else before
    stream = client.completions.create(model="tiny", prompt="abort count", stream=True, temperature=0,
                                       max_tokens=400, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i >= 2:
            break
    stream.close()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=0.5,
                   json={"prompt": "x", "max_tokens": 480, "ignore_eos": True, "temperature": 0})
    deadline = time.monotonic() + 10
    while metric(server, name, reason="client_disconnect") < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, name, reason="client_disconnect") == before + 2
    assert wait_pages(server, 0.0) == 0.0


def test_metrics_report_host_and_optional_pages_of_the_hierarchy():
    engine = Engine(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, kv_pool_bytes=16 << 20, preset="adaptive"))
    with ServerThread(engine, ServerConfig(drain_timeout_s=2)) as srv:
        assert metric(srv, "dhisparse_host_pages_total") > 0
        assert metric(srv, "dhisparse_optional_pages") == 0.0
        body = {"prompt": "hierarchy " * 20, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        seen = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 20:
                    seen.append(metric(srv, "dhisparse_host_pages_used"))
                    seen.append(metric(srv, "dhisparse_request_slots_used"))
        assert seen[0] > 0 and seen[1] == 1, seen
        assert wait_pages(srv, 0.0) == 0.0
        assert metric(srv, "dhisparse_host_pages_used") == 0.0


def test_a_request_that_fails_in_the_engine_is_a_500_for_it_alone(server, client, engine, monkeypatch):
    """Issue 24 item 1: one request's failure (here an injected sampling fault) is a 500-class
    error for that request, streamed or not; the engine keeps serving everyone else."""
    from dhisparse.core.sampling import Sampler

    orig = Sampler.draw

    def draw(probs, generator):
        if generator is not None and generator.initial_seed() == 4242:
            raise RuntimeError("injected")
        return orig(probs, generator)

    monkeypatch.setattr(Sampler, "draw", staticmethod(draw))
    bad = {"prompt": "hi", "max_tokens": 4, "temperature": 0.7, "seed": 4242}
    r = post(server, "/v1/completions", bad)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    r = post(server, "/v1/completions", {**bad, "stream": True})
    assert r.status_code == 200 and "request_failed" in r.text and r.text.rstrip().endswith("data: [DONE]")
    ok = client.completions.create(model="tiny", prompt="hello", seed=1, temperature=0.7, max_tokens=4)
    assert ok.choices[0].finish_reason == "length"
    assert httpx.get(server.url + "/health").status_code == 200


# ---- the sampling API (issue 28 item 3) -----------------------------------------------------------
def capture(engine) -> list:
    """Logits tensors the engine's model returns from now on (its `logits` wrapped; undo: del)."""
    return capture_logits(engine)


def piece(tok: int) -> str:
    return bytes([tok - 3]).decode("utf-8", errors="replace") if 3 <= tok < 259 else ""


def test_completion_logprobs_are_log_softmax_of_the_sampled_logits(client, engine):
    import torch
    seen = capture(engine)
    try:
        r = client.completions.create(model="tiny", prompt="Hi there", max_tokens=6, temperature=0.9, seed=5,
                                      logprobs=3, extra_body={"ignore_eos": True})
    finally:
        del engine.model.logits
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(seen) == 6
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for tok, value, top, logits in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, seen):
        ref = torch.log_softmax(logits[-1].float(), -1)
        ids = [t for t in range(ref.numel()) if piece(t) == tok]
        assert min(abs(float(ref[t]) - value) for t in ids) < 1e-4
        best = torch.topk(ref, 3).values.tolist()
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())


def test_chat_logprobs_and_top_logprobs_streamed_and_not(client, engine):
    import torch
    msgs = [{"role": "user", "content": "logprobs please"}]
    seen = capture(engine)
    try:
        r = client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, top_logprobs=2, **GREEDY)
    finally:
        del engine.model.logits
    content = r.choices[0].logprob if False else r.choices[0].logprobs.content
    assert len(content) == 12 and bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    for c, logits in zip(content, seen):
        ref = torch.log_softmax(logits[-1].float(), -1)
        tok = c.bytes[0] + 3
        assert c.logprob == pytest.approx(float(ref[tok]), abs=1e-4) and tok == int(ref.argmax())  # greedy
        assert [a.bytes[0] + 3 for a in c.top_logprobs] == torch.topk(ref, 2).indices.tolist()
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, top_logprobs=2,
                                                stream=True, **GREEDY))
    streamed = [c for p in parts if p.choices and p.choices[0].logprobs for c in p.choices[0].logprobs.content]
    assert [(c.bytes, round(c.logprob, 4)) for c in streamed] == [(c.bytes, round(c.logprob, 4)) for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=msgs, top_logprobs=2, **GREEDY)


def test_echo_with_prompt_logprobs_and_max_tokens_zero(client, engine):
    import torch
    prompt = "Score this text"
    seen = capture(engine)
    try:
        r = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    finally:
        del engine.model.logits
    c = r.choices[0]
    assert c.text == prompt and c.logprobs.tokens == list(prompt) and c.logprobs.token_logprobs[0] is None
    ref = torch.log_softmax(seen[0].float(), -1)  # the prompt's prefill: row j predicts position j + 1
    ids = engine.tokenizer.encode(prompt)
    for pos in range(1, len(ids)):
        assert c.logprobs.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    g = client.completions.create(model="tiny", prompt=prompt, echo=True, **GREEDY).choices[0].text
    assert g.startswith(prompt) and len(g) > len(prompt)
    s = list(client.completions.create(model="tiny", prompt=prompt, echo=True, stream=True, **GREEDY))
    assert "".join(x.choices[0].text for x in s if x.choices) == g


def test_n_with_seed_is_reproducible_and_each_choice_is_seed_plus_i(client):
    kw = dict(model="tiny", prompt="Once upon", temperature=1.0, max_tokens=10, seed=11, extra_body={"ignore_eos": True})
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in a.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    for i in range(3):
        assert client.completions.create(**{**kw, "seed": 11 + i}).choices[0].text == texts[i]
    assert a.usage.completion_tokens == 30 and a.usage.prompt_tokens == len("Once upon")
    chunks = list(client.completions.create(n=3, stream=True, **kw))
    joined = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [joined[i] for i in range(3)] == texts
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                          temperature=1.0, max_tokens=6, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


def test_best_of_returns_the_highest_cumulative_logprob(client):
    kw = dict(model="tiny", prompt="best", temperature=1.0, max_tokens=6, seed=2, logprobs=0,
              extra_body={"ignore_eos": True})
    cands = client.completions.create(n=4, **kw).choices
    best = max(cands, key=lambda c: sum(c.logprobs.token_logprobs))
    r = client.completions.create(n=1, best_of=4, **kw)
    assert len(r.choices) == 1 and r.choices[0].text == best.text and r.choices[0].index == 0
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=3, best_of=2, **kw)


def test_penalties_bias_and_min_tokens_through_the_api(client):
    base = client.completions.create(model="tiny", prompt="aaaa", **GREEDY).choices[0].text
    pen = client.completions.create(model="tiny", prompt="aaaa", frequency_penalty=2.0, presence_penalty=1.0,
                                    temperature=0, max_tokens=12, extra_body={"ignore_eos": True,
                                                                              "repetition_penalty": 1.5})
    assert pen.choices[0].text != base
    forced = client.completions.create(model="tiny", prompt="x", logit_bias={str(ord("A") + 3): 100}, **GREEDY)
    assert forced.choices[0].text == "A" * 12
    eos = {"2": 100}
    assert client.completions.create(model="tiny", prompt="x", temperature=0, max_tokens=12,
                                     logit_bias=eos).usage.completion_tokens == 1
    r = client.completions.create(model="tiny", prompt="x", temperature=0, max_tokens=12, logit_bias=eos,
                                  extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="x", logit_bias={"99999": 1}, **GREEDY)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny", prompt="x", presence_penalty=3, **GREEDY)


def test_batched_prompts_give_one_choice_per_prompt_in_order(client):
    prompts = ["first prompt", "second", "third"]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(6))
    for i, p in enumerate(prompts):
        single = client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == single
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    ids = client.completions.create(model="tiny", prompt=[[70, 80, 90], [71]], **GREEDY)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 4
    s = list(client.completions.create(model="tiny", prompt=prompts[:2], stream=True, **GREEDY))
    assert {c.choices[0].index for c in s if c.choices} == {0, 1}


def test_unset_max_tokens_runs_up_to_the_context(client):
    prompt = "y" * (MAX_MODEL_LEN - 7)
    r = client.completions.create(model="tiny", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=8)


# ---- OpenAI shapes (issue 28 item 4) ---------------------------------------------------------------
def test_models_retrieve_and_unknown_model_404(server, client):
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.put(server.url + "/v1/models")
    assert r.status_code == 405 and "error" in r.json()


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# Every request field of the OpenAI API reference (completions: legacy; chat: chat.completions.create),
# with a value that turns it on and either a check that it was applied, or None: a 400 naming it.
COMPLETION_FIELDS = {
    "model": ("tiny", lambda r: r["model"] == "tiny"),
    "prompt": ("Hello", lambda r: r["usage"]["prompt_tokens"] == 5),
    "best_of": (2, lambda r: len(r["choices"]) == 1),
    "echo": (True, lambda r: r["choices"][0]["text"].startswith("Hello")),
    "frequency_penalty": (1.0, lambda r: True),  # effect: test_penalties_bias_and_min_tokens_through_the_api
    "logit_bias": ({"68": 100}, lambda r: set(r["choices"][0]["text"]) == {"A"}),
    "logprobs": (2, lambda r: len(r["choices"][0]["logprobs"]["top_logprobs"][0]) >= 1),
    "max_tokens": (3, lambda r: r["usage"]["completion_tokens"] == 3),
    "n": (2, lambda r: len(r["choices"]) == 2),
    "presence_penalty": (1.0, lambda r: True),
    "seed": (5, lambda r: True),  # effect: test_n_with_seed_is_reproducible_and_each_choice_is_seed_plus_i
    "stop": (["\n"], lambda r: "\n" not in r["choices"][0]["text"]),
    "stream": (True, "stream"),
    "stream_options": ({"include_usage": True}, "stream"),
    "suffix": ("tail", None),
    "temperature": (0.5, lambda r: True),
    "top_p": (0.5, lambda r: True),
    "user": ("user-1", lambda r: True),
}
CHAT_FIELDS = {
    "messages": ([{"role": "user", "content": "hi"}], lambda r: r["choices"][0]["message"]["role"] == "assistant"),
    "model": ("tiny", lambda r: r["model"] == "tiny"),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "frequency_penalty": (1.0, lambda r: True),
    "function_call": ("auto", None),
    "functions": ([TOOL["function"]], None),
    "logit_bias": ({"68": 100}, lambda r: set(r["choices"][0]["message"]["content"]) == {"A"}),
    "logprobs": (True, lambda r: len(r["choices"][0]["logprobs"]["content"]) == r["usage"]["completion_tokens"]),
    "max_completion_tokens": (3, lambda r: r["usage"]["completion_tokens"] == 3),
    "max_tokens": (3, lambda r: r["usage"]["completion_tokens"] == 3),
    "metadata": ({"k": "v"}, None),
    "modalities": (["text", "audio"], None),
    "n": (2, lambda r: len(r["choices"]) == 2),
    "parallel_tool_calls": (False, lambda r: len(r["choices"][0]["message"]["tool_calls"]) == 1),
    "prediction": ({"type": "content", "content": "x"}, None),
    "presence_penalty": (1.0, lambda r: True),
    "prompt_cache_key": ("k", None),
    "reasoning_effort": ("low", None),
    "response_format": ({"type": "json_object"}, lambda r: r["choices"][0]["message"]["content"].startswith("{")),
    "safety_identifier": ("s", None),
    "seed": (5, lambda r: True),
    "service_tier": ("flex", None),
    "stop": (["\n"], lambda r: "\n" not in r["choices"][0]["message"]["content"]),
    "store": (True, None),
    "stream": (True, "stream"),
    "stream_options": ({"include_usage": True}, "stream"),
    "temperature": (0.5, lambda r: True),
    "tool_choice": ("required", lambda r: r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"),
    "tools": ([TOOL], lambda r: r["usage"]["prompt_tokens"] > 100),  # the tools are in the prompt
    "top_logprobs": (2, lambda r: len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "top_p": (0.5, lambda r: True),
    "user": ("user-1", lambda r: True),
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
}
REQUIRED = {"tools": [TOOL], "tool_choice": "required", "max_tokens": 64}
NEEDS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "tool_choice": REQUIRED,
         "parallel_tool_calls": REQUIRED}


@pytest.mark.parametrize("path, fields", [("/v1/completions", COMPLETION_FIELDS), ("/v1/chat/completions", CHAT_FIELDS)])
def test_every_openai_field_is_applied_or_rejected_by_name(server, path, fields):
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    base.update({"prompt": "Hello"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    for name, (value, check) in fields.items():
        body = {**base, **NEEDS.get(name, {}), name: value}
        if name == "max_completion_tokens":
            body.pop("max_tokens")
        r = post(server, path, body)
        if check is None:
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name, (name, r.text)
        elif check == "stream":
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), (name, r.text)
            if name == "stream_options":
                assert '"usage":{' in r.text.rsplit("data:", 2)[1], name
        else:
            assert r.status_code == 200, (name, r.text)
            assert check(r.json()), (name, r.json())


def test_serving_log_lines_while_there_is_work(capsys):
    """`--log-interval`: the engine worker writes a one-line throughput / queue / pool summary
    every interval while there is work (engine/progress.py), nothing while idle. (Its own engine:
    the module's engine is served by the module's server thread.)"""
    own = Engine(EngineConfig(device="cpu", max_model_len=MAX_MODEL_LEN, kv_pool_bytes=16 << 20))
    with ServerThread(own, ServerConfig(drain_timeout_s=5, log_interval_s=0.05)) as srv:
        body = {"model": "tiny", "prompt": "log me", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("serving:")]
    assert lines and "tok/s" in lines[0] and "KV pool" in lines[0]
