"""Soak (issue 24): mixed streamed and non-streamed requests with client disconnects against
`dhisparse serve` (in a thread, 127.0.0.1) under hisparse, adaptive with forced reclaim (a small
pool) and adaptive+spec (n-gram drafter). Afterwards every gauge is back to its idle baseline and
fixed greedy prompts answer exactly as before the soak.

The CI-sized variant sends 60 requests per preset (a few seconds each on 2 CPU cores); the `slow`
variant 400 (`python -m pytest -m slow tests/test_server_soak.py`). Every loop is bounded in count
and time, and only loopback is contacted."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.server import ServerConfig, ServerThread

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_pages_used", "host_pages_used", "optional_pages",
          "request_slots_used", "engine_decoding")
PRESETS = {
    "hisparse": dict(preset="hisparse", hot_cache_rows=32),
    "adaptive-reclaim": dict(preset="adaptive", hot_cache_rows=32, kv_pool_bytes=200 * 3840),  # ~200 pages of tiny
    "adaptive+spec": dict(preset="adaptive+spec", hot_cache_rows=32, speculative_algorithm="ngram"),
}
FIXED = [f"fixed prompt {i}: " + "abc " * (5 + 7 * i) for i in range(3)]


def gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("dhisparse_") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0][len("dhisparse_"):]
            if name in GAUGES:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def greedy(url: str) -> list[str]:
    body = lambda p: {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}  # noqa: E731
    return [httpx.post(url + "/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"] for p in FIXED]


def one_request(url: str, i: int, rng: random.Random) -> str:
    """A streamed or non-streamed completion; about one in five is abandoned early."""
    prompt = f"soak {i} " + "xyz " * rng.randint(2, 60)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(4, 40), "temperature": rng.choice([0, 0.8]),
            "seed": i, "ignore_eos": True}
    drop = rng.random() < 0.2
    if rng.random() < 0.5:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if drop and n >= 2:
                    return "dropped-stream"
        return f"stream-{r.status_code}"
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=0.05 if drop else 60)
        return f"plain-{r.status_code}"
    except httpx.TimeoutException:
        return "dropped-plain"


def settle(url: str, baseline: dict[str, float], timeout_s: float = 20.0) -> dict[str, float]:
    deadline, now = time.monotonic() + timeout_s, gauges(url)
    while now != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
        now = gauges(url)
    return now


def soak(preset: str, n_requests: int, clients: int = 4) -> list[str]:
    base = dict(device="cpu", page_size=4, max_model_len=512, kv_pool_bytes=16 << 20, host_pool_bytes=64 << 20,
                max_running_requests=8)
    eng = Engine(EngineConfig(**{**base, **PRESETS[preset]}))
    with ServerThread(eng, ServerConfig(drain_timeout_s=5)) as srv:
        before, baseline = greedy(srv.url), settle(srv.url, {}, 0.0)
        rng = random.Random(7)
        seeds = [random.Random(rng.random()) for _ in range(n_requests)]
        with ThreadPoolExecutor(clients) as pool:
            kinds = list(pool.map(lambda i: one_request(srv.url, i, seeds[i]), range(n_requests), timeout=600))
        assert settle(srv.url, baseline) == baseline, f"{preset}: gauges did not return to {baseline}"
        assert greedy(srv.url) == before
        assert httpx.get(srv.url + "/health").status_code == 200
        stats = eng.stats().as_dict()
        if preset == "adaptive-reclaim":
            assert stats["reclaimed_pages"] > 0  # the small pool forced reclaims
    assert not [k for k in kinds if k.endswith(("-500", "-502", "-503"))], kinds
    return kinds


@pytest.mark.parametrize("preset", list(PRESETS))
def test_soak_ci_sized(preset):
    kinds = soak(preset, 60)
    assert any(k.startswith("dropped") for k in kinds) and any(k == "stream-200" for k in kinds)


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_soak_long(preset):
    soak(preset, 400, clients=8)
