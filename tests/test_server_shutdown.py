"""Graceful shutdown: in-flight streams drain (shutdown_mode="drain") or end with finish_reason
"abort" (shutdown_mode="abort"); either way the engine thread stops and the KV pool is empty."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.models.registry import load_model
from dhisparse.server import ServerConfig, ServerThread


@pytest.fixture(scope="module")
def loaded():
    return load_model("tiny")


def stream_until_end(url: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    """Stream one completion; record finish reasons and whether [DONE] arrived."""
    body = {"model": "tiny", "prompt": "shutdown", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    out["reasons"], out["done"] = [], False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    started.set()
                    out["reasons"] += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    started.set()


@pytest.mark.parametrize("mode, max_tokens, reason", [("abort", 2000, "abort"), ("drain", 60, "length")])
def test_shutdown_modes(loaded, mode, max_tokens, reason):
    engine = Engine(EngineConfig(device="cpu", max_model_len=4096, kv_pool_bytes=64 << 20), loaded=loaded)
    srv = ServerThread(engine, ServerConfig(shutdown_mode=mode, drain_timeout_s=20)).start()
    started, out = threading.Event(), {}
    t = threading.Thread(target=stream_until_end, args=(srv.url, max_tokens, started, out))
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    srv.stop()
    t.join(30)
    assert out["reasons"] == [reason] and out["done"], out
    assert time.monotonic() - t0 < 20
    assert not srv.state.worker.alive
    assert engine.stats().kv_pages_used == 0 and not engine.has_unfinished()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def post_until_end(url: str, path: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(url + path, json=body, timeout=60)
        out["status"], out["body"] = r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        out["error"] = repr(e)


def stream_lines(url: str, path: str, body: dict, started: threading.Event, out: dict) -> None:
    out["reasons"], out["done"], out["after_done"] = [], False, 0
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if out["done"] and line:
                    out["after_done"] += 1
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    started.set()
                    chunk = json.loads(line[6:])  # every chunk is whole JSON
                    out["reasons"] += [c["finish_reason"] for c in chunk.get("choices", []) if c["finish_reason"]]
    except (httpx.HTTPError, ValueError) as e:
        out["error"] = repr(e)
    started.set()


@pytest.mark.parametrize("mode", ["drain", "abort"])
def test_shutdown_past_drain_timeout_ends_everything_cleanly(loaded, mode, capfd):
    """Issue 24 item 6: past the drain timeout every stream ends with an abort chunk and [DONE],
    every non-streamed request with a JSON 503, and nothing logs a traceback (today: streams cut
    mid-chunk, plain-text 500s and CancelledError tracebacks)."""
    engine = Engine(EngineConfig(device="cpu", max_model_len=4096, kv_pool_bytes=64 << 20), loaded=loaded)
    srv = ServerThread(engine, ServerConfig(shutdown_mode=mode, drain_timeout_s=1), log_level="info").start()
    rec = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.asgi", "dhisparse", "asyncio")]
    for lg in loggers:
        lg.addHandler(rec)
    long = {"model": "tiny", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    msgs = [{"role": "user", "content": "shutdown"}]
    streams = [({"prompt": "s1", **long, "stream": True}, "/v1/completions"),
               ({"messages": msgs, **long, "stream": True, "stream_options": {"include_usage": True}},
                "/v1/chat/completions")]
    plain = [({"prompt": "p1", **long}, "/v1/completions"), ({"messages": msgs, **long}, "/v1/chat/completions")]
    outs, threads, events = [], [], []
    try:
        for body, path in streams:
            ev, out = threading.Event(), {}
            t = threading.Thread(target=stream_lines, args=(srv.url, path, body, ev, out))
            outs.append(out), threads.append(t), events.append(ev)
        for body, path in plain:
            out = {}
            t = threading.Thread(target=post_until_end, args=(srv.url, path, body, out))
            outs.append(out), threads.append(t)
        for t in threads:
            t.start()
        assert all(ev.wait(30) for ev in events)
        deadline = time.monotonic() + 30
        while engine.stats().running < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats().running == 4
        t0 = time.monotonic()
        srv.stop()
        for t in threads:
            t.join(30)
        assert time.monotonic() - t0 < 15
    finally:
        for lg in loggers:
            lg.removeHandler(rec)
    for out in outs[:2]:
        assert out.get("status") == 200 and "error" not in out, out
        assert out["reasons"] == ["abort"] and out["done"] and out["after_done"] == 0, out
    for out in outs[2:]:
        assert out.get("status") == 503 and "error" not in out, out
        err = out["body"]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error", err
    bad = [r for r in rec.records if r.exc_info or "Traceback" in r.getMessage() or "CancelledError" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out and "CancelledError" not in captured.err + captured.out
    assert not srv.state.worker.alive
    assert engine.stats().kv_pages_used == 0 and not engine.has_unfinished()
