"""In-process closed loop: the harness drives `Engine.step()` itself (no threads, no HTTP).

Client k (k < offered concurrency at that moment) sends its next request as soon as its previous
one finishes; when the offered concurrency falls, surplus clients stop after their current
request (in-flight requests drain). A duration-bounded run aborts what is still in flight at the
end and counts the tokens generated inside the window; a request-count run waits for the last.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from dhisparse.bench.records import RequestRecord, RunTrace, StepSample
from dhisparse.bench.workload import Phases, Workload, prefix_ids, suffix_text
from dhisparse.engine.series import SeriesRecorder
from dhisparse.engine.warmup import warm_up
from dhisparse.core.params import SamplingParams

Progress = Callable[[float, int], None]  # (elapsed s, completed requests)


class _Live:
    """A request in flight."""

    __slots__ = ("index", "client", "submit", "first", "tokens", "prompt_len", "queue")

    def __init__(self, index: int, client: int, submit: float, prompt_len: int) -> None:
        self.index, self.client, self.submit, self.prompt_len = index, client, submit, prompt_len
        self.first: float | None = None
        self.tokens = 0
        self.queue: float | None = None  # allocation wait, known from the first token on (kept for aborts)


class InProcessLoop:
    """One closed-loop run against `engine`; call `run()` once."""

    def __init__(self, engine, workload: Workload, phases: Phases, progress: Progress | None = None,
                 sample_interval_s: float = 1.0) -> None:
        self.engine, self.workload, self.phases, self.progress = engine, workload, phases, progress
        self.params = SamplingParams(max_tokens=workload.output_len, temperature=workload.temperature,
                                     ignore_eos=workload.ignore_eos, seed=0 if workload.temperature > 0 else None)
        self.prefix = prefix_ids(engine.tokenizer, workload.input_len, engine.model_config.vocab_size)
        self.live: dict[str, _Live] = {}
        self.idle_clients = set(range(phases.max_concurrency))
        self.records: list[RequestRecord] = []
        self.steps: list[StepSample] = []
        self.series = SeriesRecorder(sample_interval_s)
        self.issued = self.window_tokens = 0
        self.started: set[int] = set()  # clients that have issued their first request
        self.t0 = 0.0

    # -- requests ---------------------------------------------------------------------------------
    def _prompt(self, index: int) -> list[int]:
        return self.prefix + self.engine.tokenizer.encode(suffix_text(index))

    def _may_issue(self, now: float) -> bool:
        w = self.workload
        if w.num_requests is not None:
            return self.issued < w.num_requests
        return now < self.phases.total_s

    def _issue(self, now: float) -> None:
        target = self.phases.target(now)
        for client in sorted(c for c in self.idle_clients if c < target):
            if not self._may_issue(now):
                return
            prompt = self._prompt(self.issued)
            cap = self.workload.max_tokens_for(client, client not in self.started, self.phases.max_concurrency)
            self.started.add(client)
            params = self.params if cap == self.params.max_tokens else replace(self.params, max_tokens=cap)
            rid = self.engine.add_request(prompt, params)
            self.live[rid] = _Live(self.issued, client, now, len(prompt))
            self.idle_clients.discard(client)
            self.issued += 1

    def _record(self, live: _Live, finish: float | None, reason: str | None, queue: float | None) -> None:
        self.records.append(RequestRecord(live.index, live.client, live.submit, live.first, finish, live.tokens,
                                          live.prompt_len, reason, queue))
        self.idle_clients.add(live.client)

    def _consume(self, outputs, now: float) -> int:
        new = 0
        for out in outputs:
            live = self.live.get(out.request_id)
            if live is None:
                continue
            n = len(out.new_token_ids)
            new += n
            live.tokens += n
            if live.first is None and n:
                self._first(live, out, now)
            if out.finished:
                del self.live[out.request_id]
                self._record(live, now, out.finish_reason, self._finish_queue(live, out))
        return new

    def _first(self, live: _Live, out, now: float) -> None:
        """A request's first token arrived at `now`: its time and its allocation wait."""
        live.first, live.queue = now, out.metrics.queue

    def _finish_queue(self, live: _Live, out) -> float | None:
        """The allocation wait recorded with a finished request."""
        return out.metrics.queue

    # -- the loop ---------------------------------------------------------------------------------
    def _done(self, now: float) -> bool:
        if now > self.workload.timeout_s:
            return True
        if self.workload.num_requests is not None:
            return self.issued >= self.workload.num_requests and not self.live
        return now >= self.phases.total_s

    def warmup(self) -> None:
        """Short requests, one per client, run to completion before the clock starts
        (`dhisparse.engine.warmup.warm_up`: a speculative engine repeats them with longer outputs
        until a round has verified drafts, so no first compile lands in the timed window)."""
        warm_up(self.engine, lambda i: self._prompt(-1 - i), self.phases.max_concurrency,
                max_tokens=self.workload.output_len, timeout_s=self.workload.timeout_s)

    def run(self) -> RunTrace:
        self.engine.prepare_prefix(self.prefix)
        if self.workload.warmup:
            self.warmup()
        self.t0 = time.perf_counter()
        now = 0.0
        while not self._done(now):
            self._issue(now)
            outputs = self.engine.step()
            now = time.perf_counter() - self.t0
            new = self._consume(outputs, now)
            if self.workload.num_requests is not None or now <= self.phases.total_s:
                self.window_tokens += new
            stats = self.engine.stats().as_dict()
            self.steps.append(StepSample(now, sum(1 for o in outputs if o.new_token_ids), stats.get("running", 0), new))
            self.series.observe(now, new, self.steps[-1].decoding, stats)
            if self.progress is not None:
                self.progress(now, len(self.records))
        return self._finish(now)

    def _finish(self, now: float) -> RunTrace:
        final = self.engine.stats().as_dict()
        for rid, live in list(self.live.items()):
            self.engine.abort(rid)
            self._record(live, None, "abort", live.queue)
        self.live.clear()
        duration = now if self.workload.num_requests is not None else min(now, self.phases.total_s)
        return RunTrace(duration, self.window_tokens, tuple(self.records), tuple(self.steps),
                        tuple(self.series.rows), final)


def run_inprocess(engine, workload: Workload, phases: Phases, progress: Progress | None = None,
                  sample_interval_s: float = 1.0) -> RunTrace:
    """Run one closed loop on `engine` (prepares the prefix first, outside the timed window)."""
    need = workload.input_len + len(engine.tokenizer.encode(suffix_text(10**6))) + workload.output_len
    if need > engine.max_model_len:
        raise ValueError(f"input_len {workload.input_len} + output_len {workload.output_len} (+ suffix) exceeds "
                         f"max_model_len {engine.max_model_len}; lower --input-len / --output-len")
    return InProcessLoop(engine, workload, phases, progress, sample_interval_s).run()
