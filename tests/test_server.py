"""The OpenAI-compatible server over real HTTP (uvicorn in a background thread, 127.0.0.1, free
port) with the built-in tiny model on CPU, driven by the official `openai` client and httpx."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.server import ServerConfig, ServerThread

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
    ({"model": "tiny", "prompt": "x", "n": 2}, "not supported"),
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
