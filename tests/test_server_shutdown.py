"""Graceful shutdown: in-flight streams drain (shutdown_mode="drain") or end with finish_reason
"abort" (shutdown_mode="abort"); either way the engine thread stops and the KV pool is empty."""

from __future__ import annotations

import json
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
