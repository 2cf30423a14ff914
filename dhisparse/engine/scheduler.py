"""Continuous-batching scheduler: waiting -> (chunked) prefill -> decode -> finished.

Each step: admit waiting requests in arrival order while a running slot is free and the KV store
can reserve the request's whole life (prompt + max output), so a running request never runs out
of KV; a request that does not fit waits (head of line, no skipping). Then fill the step's token
budget: one token per decoding request first, then prefill chunks in admission order.
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
    def __init__(self, store: KVStore, max_running: int, token_budget: int, on_admit=None) -> None:
        self.store, self.max_running, self.token_budget = store, max_running, token_budget
        self.on_admit = on_admit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._blocked_logged: str | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.store.admit(req.request_id, req.max_total_tokens, len(req.prompt_ids)):
                if self._blocked_logged != req.request_id:
                    log.info("request %s waits: KV pool cannot reserve %d tokens yet", req.request_id, req.max_total_tokens)
                    self._blocked_logged = req.request_id
                return
            self.waiting.popleft()
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
                n = min(budget, len(req.prompt_ids) - req.num_computed)
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
