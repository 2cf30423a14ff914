"""HTTP pieces of the benchmark client: one streamed completion, and a `/metrics` scrape."""

from __future__ import annotations

import json
from typing import Callable

import httpx

from dhisparse.bench.records import RequestRecord

ENGINE_PREFIX = "dhisparse_engine_"


class StreamResult:
    """What the client saw of one streamed request (times from the clock passed in)."""

    __slots__ = ("submit", "first", "finish", "chunks", "completion_tokens", "prompt_tokens", "finish_reason", "error")

    def __init__(self, submit: float) -> None:
        self.submit = submit
        self.first: float | None = None
        self.finish: float | None = None
        self.chunks = 0
        self.completion_tokens: int | None = None
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    def record(self, index: int, client: int) -> RequestRecord:
        n = self.completion_tokens if self.completion_tokens is not None else self.chunks
        reason = self.finish_reason if self.finish is not None else (self.finish_reason or "abort")
        return RequestRecord(index, client, self.submit, self.first, self.finish, n, self.prompt_tokens, reason)

    def on_event(self, obj: dict, t: float) -> None:
        for choice in obj.get("choices") or []:
            self.chunks += 1
            if self.first is None:
                self.first = t
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.finish = t
        usage = obj.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens", 0)


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, res: StreamResult,
                            clock: Callable[[], float]) -> None:
    """POST a streaming completion and fill `res` as SSE events arrive."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = str(obj["error"].get("message", obj["error"]))
                return
            res.on_event(obj, clock())


def parse_engine_metrics(text: str) -> dict:
    """`dhisparse_engine_<stat>{...} value` lines -> {stat: value}."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(ENGINE_PREFIX):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0][len(ENGINE_PREFIX):]
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


async def engine_stats(client: httpx.AsyncClient, base_url: str) -> dict | None:
    """Scrape the server's engine stats; None when it has no dhisparse /metrics."""
    try:
        r = await client.get(f"{base_url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_engine_metrics(r.text) or None
