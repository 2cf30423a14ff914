"""Operator feedback while an engine runs: the periodic serving log line (as SGLang's "Decode batch"
line) and the prefill progress line of `dhisparse generate`. Both read `EngineStats.as_dict()`
snapshots and keep no reference to the engine.

`ServingLog` is a callable the server's engine worker calls with each stats snapshot it takes
(server/worker.py, `EngineWorker._step`, right after `self.stats = self._snapshot()`):

    serving_log = ServingLog(interval_s=10.0)
    ...
    self.stats = self._snapshot()
    serving_log(self.stats)

It writes one line every `interval_s` seconds while there is work (requests running or waiting,
or tokens made since the last line), nothing while idle:

    serving: gen 412.3 tok/s, prefill 5120.0 tok/s, running 12, waiting 3, KV pool 41.2% (824/2000 pages), host 3.1%
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("dhisparse.serving")


def _share(used: int, total: int) -> float:
    return 100.0 * used / total if total else 0.0


def serving_line(stats: dict, gen_tok_s: float, prefill_tok_s: float) -> str:
    """The one-line summary of a stats snapshot and the rates since the previous line."""
    used, total = int(stats.get("kv_pages_used", 0)), int(stats.get("kv_pages_total", 0))
    line = (f"serving: gen {gen_tok_s:.1f} tok/s, prefill {prefill_tok_s:.1f} tok/s, running {stats.get('running', 0)}, "
            f"waiting {stats.get('waiting', 0)}, KV pool {_share(used, total):.1f}% ({used}/{total} pages)")
    host_used, host_total = int(stats.get("host_pages_used", 0)), int(stats.get("host_pages_total", 0))
    if host_total:
        line += f", host {_share(host_used, host_total):.1f}%"
    if "coverage" in stats:
        line += f", resident coverage {100.0 * float(stats['coverage']):.1f}%"
    return line


class ServingLog:
    """Callable on stats snapshots; emits `serving_line` every `interval_s` seconds of work.

    emit: where the line goes (default: the `dhisparse.serving` logger at INFO); clock: seconds."""

    def __init__(self, interval_s: float = 10.0, emit: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"serving log interval must be > 0 seconds; got {interval_s}")
        self.interval_s, self.clock = interval_s, clock
        self.emit = emit or (lambda line: log.info("%s", line))
        self._t: float | None = None
        self._gen = self._prefill = 0

    def __call__(self, stats: dict) -> None:
        now = self.clock()
        gen, prefill = int(stats.get("generated_tokens", 0)), int(stats.get("prefill_tokens", 0))
        if self._t is None:
            self._t, self._gen, self._prefill = now, gen, prefill
            return
        dt = now - self._t
        if dt < self.interval_s:
            return
        busy = stats.get("running", 0) or stats.get("waiting", 0) or gen > self._gen or prefill > self._prefill
        if busy:
            self.emit(serving_line(stats, (gen - self._gen) / dt, (prefill - self._prefill) / dt))
        self._t, self._gen, self._prefill = now, gen, prefill


class PrefillProgress:
    """`dhisparse generate`: "prefill: 2048/4700 tokens (43%), 1.2 s" lines while prompts of at
    least `min_tokens` tokens prefill, at most one per `interval_s`; a last line when done."""

    def __init__(self, prompt_tokens: int, emit: Callable[[str], None], min_tokens: int = 2048,
                 interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.emit, self.interval_s, self.clock = prompt_tokens, emit, interval_s, clock
        self.active = prompt_tokens >= min_tokens
        self._t0 = clock()
        self._last = self._t0
        self._base: int | None = None
        self.done = False

    def __call__(self, stats: dict) -> None:
        if not self.active or self.done:
            return
        filled = int(stats.get("prefill_tokens", 0))
        if self._base is None:
            self._base = filled
        n = min(filled - self._base, self.total)
        now = self.clock()
        if n >= self.total:
            self.done = True
            self.emit(f"prefill: {self.total}/{self.total} tokens in {now - self._t0:.1f} s")
        elif now - self._last >= self.interval_s:
            self._last = now
            self.emit(f"prefill: {n}/{self.total} tokens ({100 * n // max(self.total, 1)}%), {now - self._t0:.1f} s")

    def start(self, stats: dict) -> None:
        """The snapshot before the prompts were queued (the engine's prefill counter is a total)."""
        self._base = int(stats.get("prefill_tokens", 0))
