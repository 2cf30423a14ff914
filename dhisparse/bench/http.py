"""Closed loop against a running OpenAI-compatible server (asyncio + httpx streaming).

TTFT and TPOT are measured client-side from the SSE stream. Prompts are token ids: the fixed
prefix is built with the server's `/tokenize` and prepared with `/v1/dhisparse/prefix` when the
server has them (dhisparse does; other servers fall back to text prompts of about input_len
words and their own prefix caching). Engine counters come from scraping `/metrics` every interval
(`dhisparse_engine_<stat>` gauges), so the series matches the in-process one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from dhisparse.bench.http_client import StreamResult, engine_stats, stream_completion
from dhisparse.bench.inproc import Progress
from dhisparse.bench.records import RequestRecord, RunTrace, StepSample
from dhisparse.engine.series import SeriesRecorder
from dhisparse.bench.workload import FILLER, Phases, Workload, filler_words, suffix_text

log = logging.getLogger("dhisparse.bench")
POLL_S = 0.05
NUM_SUFFIXES = 32


class HttpBenchError(ValueError):
    """The server refused the benchmark's requests; the message carries its answer."""


@dataclass(frozen=True)
class HttpTarget:
    """A running server: base URL, the model name to send, its preset label, and the API key
    sent as `Authorization: Bearer` on every request (None: none; README Security)."""

    url: str
    model: str
    preset: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @classmethod
    def connect(cls, url: str, model: str | None = None, timeout_s: float = 10.0, api_key: str | None = None) -> "HttpTarget":
        url = url.rstrip("/").removesuffix("/v1")
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            r = httpx.get(f"{url}/v1/models", timeout=timeout_s, headers=auth)
            if r.status_code == 401:
                raise HttpBenchError(f"--url {url}: the server wants an API key; pass --api-key or set DHISPARSE_API_KEY")
            card = r.json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise HttpBenchError(f"--url {url}: cannot list models at /v1/models ({e}); is the server up?") from None
        return cls(url, model or card["id"], str(card.get("preset", "server")), api_key)


async def _tokenize(client: httpx.AsyncClient, target: HttpTarget, text: str) -> list[int] | None:
    r = await client.post(f"{target.url}/tokenize", json={"model": target.model, "prompt": text})
    return r.json()["tokens"] if r.status_code == 200 else None


async def build_prompts(client: httpx.AsyncClient, target: HttpTarget, input_len: int) -> tuple[list, list[str]]:
    """(prompts cycled over requests, notes). Token-id prompts with a prepared prefix when possible."""
    text = FILLER
    ids = await _tokenize(client, target, text)
    if ids is None:
        prefix = filler_words(input_len)
        return [prefix + suffix_text(i) for i in range(NUM_SUFFIXES)], [
            "server has no /tokenize: text prompts of input_len words; input length is approximate"]
    while len(ids) < input_len:
        text *= 2
        ids = await _tokenize(client, target, text)
    prefix = ids[:input_len]
    suffixes = [await _tokenize(client, target, suffix_text(i)) for i in range(NUM_SUFFIXES)]
    r = await client.post(f"{target.url}/v1/dhisparse/prefix", json={"model": target.model, "prompt": prefix})
    notes = [] if r.status_code == 200 else [f"prefix not prepared (HTTP {r.status_code}): prefill per request"]
    if r.status_code not in (200, 404):
        raise HttpBenchError(f"preparing the prefix failed: HTTP {r.status_code} {r.text[:300]}")
    return [prefix + s for s in suffixes], notes


class HttpLoop:
    """One closed-loop run over HTTP; `await run()` once."""

    def __init__(self, target: HttpTarget, workload: Workload, phases: Phases, progress: Progress | None,
                 sample_interval_s: float) -> None:
        self.target, self.workload, self.phases, self.progress = target, workload, phases, progress
        self.records: list[RequestRecord] = []
        self.steps: list[StepSample] = []
        self.series = SeriesRecorder(sample_interval_s)
        self.live: dict[int, StreamResult] = {}
        self.issued = 0
        self.t0 = 0.0
        self.notes: list[str] = []
        self.last_stats: dict = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _may_issue(self) -> bool:
        if self.workload.num_requests is not None:
            return self.issued < self.workload.num_requests
        return self.now() < self.phases.total_s

    def _done(self) -> bool:
        if self.workload.num_requests is not None:
            return self.issued >= self.workload.num_requests and not self.live
        return self.now() >= self.phases.total_s

    def _body(self, index: int, prompts: list, max_tokens: int) -> dict:
        w = self.workload
        return {"model": self.target.model, "prompt": prompts[index % len(prompts)], "max_tokens": max_tokens,
                "temperature": w.temperature, "ignore_eos": w.ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}

    async def _client(self, client: httpx.AsyncClient, k: int, prompts: list) -> None:
        first = True
        while not self._done():
            if k >= self.phases.target(self.now()) or not self._may_issue():
                await asyncio.sleep(POLL_S)
                continue
            index, self.issued = self.issued, self.issued + 1
            cap = self.workload.max_tokens_for(k, first, self.phases.max_concurrency)
            first = False
            res = StreamResult(self.now())
            self.live[index] = res
            try:
                await stream_completion(client, f"{self.target.url}/v1/completions", self._body(index, prompts, cap), res,
                                        self.now)
            finally:
                del self.live[index]
                self.records.append(res.record(index, k))
            if res.error is not None:
                raise HttpBenchError(f"request {index} failed: {res.error}")

    async def _sampler(self, client: httpx.AsyncClient) -> None:
        next_scrape = 0.0
        while not self._done():
            t = self.now()
            decoding = sum(1 for r in self.live.values() if r.first is not None)
            if t >= next_scrape:
                self.last_stats = await engine_stats(client, self.target.url) or self.last_stats
                next_scrape = t + self.series.interval_s / 2
            running = int(self.last_stats.get("running", len(self.live)))
            self.steps.append(StepSample(t, decoding, running))
            self.series.observe(t, 0, decoding, self.last_stats)
            if self.progress is not None:
                self.progress(t, len(self.records))
            await asyncio.sleep(POLL_S)

    async def run(self) -> RunTrace:
        limits = httpx.Limits(max_connections=self.phases.max_concurrency + 4)
        timeout = httpx.Timeout(self.workload.timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=self.target.headers) as client:
            prompts, self.notes = await build_prompts(client, self.target, self.workload.input_len)
            for note in self.notes:
                log.warning("%s: %s", self.target.url, note)
            if self.workload.warmup:
                await self._warmup(client, prompts)
            start = await engine_stats(client, self.target.url)
            self.t0 = time.perf_counter()
            tasks = [asyncio.create_task(self._client(client, k, prompts)) for k in range(self.phases.max_concurrency)]
            tasks.append(asyncio.create_task(self._sampler(client)))
            await self._wait(tasks)
            duration = self.now() if self.workload.num_requests is not None else self.phases.total_s
            end = await engine_stats(client, self.target.url)
            await self._cancel(tasks)
        return self._trace(duration, start, end)

    async def _warmup(self, client: httpx.AsyncClient, prompts: list) -> None:
        """One short request per client, all at once, before the clock starts."""
        def body(k: int) -> dict:
            b = dict(self._body(k, prompts, min(4, self.workload.output_len)), stream=False)
            b.pop("stream_options")
            return b

        await asyncio.gather(*(client.post(f"{self.target.url}/v1/completions", json=body(k))
                               for k in range(self.phases.max_concurrency)))

    async def _wait(self, tasks: list[asyncio.Task]) -> None:
        """Until the window closes (duration), every request finished (count) or timeout_s."""
        limit = self.workload.timeout_s
        if self.workload.num_requests is None:
            limit = min(limit, self.phases.total_s)
        done, _ = await asyncio.wait(tasks, timeout=limit, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                await self._cancel(tasks)
                raise t.exception()

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task]) -> None:
        """Cancel what still runs (closing a stream makes the server abort that request)."""
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _trace(self, duration: float, start: dict | None, end: dict | None) -> RunTrace:
        if start and end and "generated_tokens" in end:
            tokens = int(end["generated_tokens"] - start.get("generated_tokens", 0))
        else:
            tokens = sum(r.output_len for r in self.records)
        return RunTrace(duration, tokens, tuple(self.records), tuple(self.steps), tuple(_rates(self.series.rows)),
                        end or {})


def _rates(rows: list[dict]) -> list[dict]:
    """Fill each row's output_tok_s from the server's generated_tokens counter."""
    out, prev = [], None
    for r in rows:
        r = dict(r)
        if prev is not None and "generated_tokens" in r and r["t"] > prev["t"]:
            r["output_tok_s"] = (r["generated_tokens"] - prev.get("generated_tokens", 0)) / (r["t"] - prev["t"])
        else:
            r["output_tok_s"] = None
        out.append(r)
        prev = r
    return out


def run_http(target: HttpTarget, workload: Workload, phases: Phases, progress: Progress | None = None,
             sample_interval_s: float = 1.0) -> RunTrace:
    """Run one closed loop against `target` and return what it observed."""
    return asyncio.run(HttpLoop(target, workload, phases, progress, sample_interval_s).run())
