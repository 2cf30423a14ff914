"""Continuous-batching scheduler: waiting -> (chunked) prefill -> decode -> finished.

Each step: admit waiting requests in arrival order while a running slot is free and the KV store
can reserve the request's whole life (prompt + max output), so a running request never runs out
of KV. A request that does not fit yet waits, but does not block the queue: up to `lookahead`
later requests that fit are admitted past it, until the first waiting request that does not fit
has waited `age_bound_s`; from then on admission is strictly first-come-first-served, so that
request is admitted as soon as memory frees (no starvation). A request that can never fit is
refused when it arrives (`KVStore.never_fits`). Then fill the step's token budget: one token per
decoding request first, then prefill chunks in admission order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from dhisparse.core.contracts import KVStore
from dhisparse.engine.request import Request, Status

log = logging.getLogger("dhisparse.scheduler")


@dataclass(frozen=True)
class Chunk:
    """Tokens all_ids[start:start+len(tokens)] of `req` run in this step; `sample` is True when
    the chunk ends at the request's last token, so its logits give the next token."""

    req: Request
    start: int
    tokens: list[int]
    sample: bool
    verify: bool = False  # speculative verification chunk: [anchor, drafts...]

    @property
    def decodes(self) -> bool:
        """The chunk is past its prompt: a decode token or a verification chunk."""
        return self.start >= len(self.req.prompt_ids)


class Scheduler:
    def __init__(self, store: KVStore, max_running: int, token_budget: int, on_admit=None, lookahead: int = 8,
                 age_bound_s: float = 10.0) -> None:
        self.store, self.max_running, self.token_budget = store, max_running, token_budget
        self.lookahead, self.age_bound_s = lookahead, age_bound_s
        self.on_admit = on_admit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._blocked_logged: str | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        """Admission in arrival order with bounded skip-ahead (module docstring).

            waiting  [ r0 (no fit, young) | r1 fits -> admitted | r2 no fit | r3 fits -> admitted ...]
                       ^ first blocked: once older than age_bound_s, nothing is admitted past it
        """
        now, i, skipped = time.perf_counter(), 0, 0
        while i < len(self.waiting) and len(self.running) < self.max_running:
            req = self.waiting[i]
            if self.store.admit(req.request_id, req.max_total_tokens, len(req.prompt_ids)):
                del self.waiting[i]
                self._start(req)
                continue
            if self._blocked_logged != req.request_id:
                log.info("request %s waits: KV pool cannot reserve %d tokens yet", req.request_id, req.max_total_tokens)
                self._blocked_logged = req.request_id
            if skipped == 0 and now - req.arrival >= self.age_bound_s:
                return  # the oldest blocked request has waited long enough: strict FCFS
            skipped += 1
            if skipped > self.lookahead:
                return
            i += 1

    def _start(self, req: Request) -> None:
        req.status, req.admitted_at = Status.RUNNING, time.perf_counter()
        if self.on_admit is not None:
            self.on_admit(req)
        self.running.append(req)

    def schedule(self) -> list[Chunk]:
        """Admit what fits and return this step's chunks (decodes first). A request whose KV is
        still being copied (the store's `loading`: a prefix import or a hand-off backup in the
        background, kv/memory/loads.py) sits this step out."""
        self._admit()
        budget = self.token_budget
        ready = [r for r in self.running if not self.store.loading(r.request_id)]
        chunks: list[Chunk] = []
        for req in ready:
            if not req.in_prefill and budget > 0:
                chunks.append(Chunk(req, req.num_computed, req.ids_from(req.num_computed), True))
                budget -= 1
        for req in ready:
            if req.in_prefill and budget > 0:
                n = min(budget, len(req.prompt_ids) - req.num_computed, self.store.prompt_chunk_limit(req.request_id) or budget)
                end = req.num_computed + n
                chunks.append(Chunk(req, req.num_computed, req.prompt_ids[req.num_computed : end], end == req.num_tokens))
                budget -= n
        return chunks

    def finish(self, req: Request, reason: str) -> None:
        """Retire a running or waiting request and free its KV."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.store.free(req.request_id)
        else:
            self.waiting.remove(req)
        req.status, req.finish_reason, req.finished_at = Status.FINISHED, reason, time.perf_counter()
