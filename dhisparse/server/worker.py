"""`EngineWorker`: the one thread that owns the engine.

The engine is not thread-safe, so HTTP handlers never touch it. They post commands (add, abort,
prepare prefix) to a thread-safe queue; the worker thread applies them between steps, runs
`engine.step()` while there is work, and sends every event for a request back to that request's
asyncio queue with `loop.call_soon_threadsafe`. Events: `accepted`, `output` (a RequestOutput),
`error` (the engine rejected the request: message), `aborted` (aborted by the server, e.g. at
shutdown), `failed` (the engine crashed: message), `done` (a prefix is ready: its length).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, NamedTuple

from dhisparse.core.parallel import RankLost
from dhisparse.core.params import SamplingParams
from dhisparse.engine.request import RequestOutput

log = logging.getLogger("dhisparse.server")
IDLE_WAIT_S = 0.05


class Event(NamedTuple):
    """One message from the engine thread to a request's handler."""

    kind: str  # accepted | output | error | aborted | failed | done
    payload: Any = None


class _Sink(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineWorker:
    """Runs `engine` in a background thread; see the module docstring for the protocol."""

    def __init__(self, engine, on_finish: Callable[[RequestOutput], None] | None = None,
                 on_stats: Callable[[dict], None] | None = None) -> None:
        """on_finish: called with each finished output; on_stats: with each stats snapshot taken
        after a step (the serving log line, engine/progress.py)."""
        self.engine = engine
        self.on_finish, self.on_stats = on_finish, on_stats
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._prefixes: dict[str, int] = {}  # export request id -> prompt length
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dhisparse-engine", daemon=True)
        self.stats: dict = self._snapshot()  # replaced after every step
        self.error: str | None = None
        self.error_status = 500  # the HTTP status of requests in flight when the engine thread failed

    # -- called from any thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue its events arrive on (call from the loop).
        The HTTP routes pass token ids, tokenized and validated off this thread (a long text prompt
        tokenized here would stall every stream); a str is accepted too and tokenized here."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request_id, prompt, params, sink))
        return sink.queue

    def prepare_prefix(self, request_id: str, prompt: str | list[int]) -> asyncio.Queue:
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("prefix", request_id, prompt, None, sink))
        return sink.queue

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None, None, None))

    def abort_all(self) -> None:
        self._commands.put(("abort_all", None, None, None, None))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and join the thread (bounded by `timeout`)."""
        self.abort_all()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self._stop.is_set():
                    self._step()
        except Exception as e:  # the engine is in an unknown state: fail everyone, stop serving
            log.exception("engine thread crashed")
            self.error = f"engine failed: {type(e).__name__}: {e}"
            self.error_status = 503 if isinstance(e, RankLost) else 500  # a lost rank: retry elsewhere
            for sink in list(self._sinks.values()):
                self._send(sink, Event("failed", self.error))
            self._sinks.clear()
        finally:
            self._abort_everything()
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Commands that arrived as the thread stopped: their handlers get `aborted`, not silence."""
        while True:
            try:
                op, rid, _, _, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if sink is not None:
                self._send(sink, Event("aborted", rid))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self._snapshot()  # aborts free pages without a step

    def _apply(self, op: str, rid: str | None, prompt: Any, params: Any, sink: _Sink | None) -> None:
        if op in ("add", "prefix"):
            try:
                if op == "add":
                    self.engine.add_request(prompt, params, request_id=rid)
                else:
                    self.engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid, export_prefix=True)
                    self._prefixes[rid] = len(prompt) if isinstance(prompt, list) else len(self.engine.encode_prompt(prompt))
            except ValueError as e:
                self._send(sink, Event("error", str(e)))
                return
            self._sinks[rid] = sink
            self._send(sink, Event("accepted", rid))
        elif op == "abort":
            self.engine.abort(rid)
            self._sinks.pop(rid, None)
            self._prefixes.pop(rid, None)
        elif op == "abort_all":
            self._abort_everything()

    def _abort_everything(self) -> None:
        """Abort every request in flight; handlers get a final output with finish_reason 'abort'."""
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            self._send(sink, Event("aborted", rid))
        self._sinks.clear()
        self._prefixes.clear()
        self.stats = self._snapshot()

    def _snapshot(self) -> dict:
        """The engine's stats (slots and host pages included: `EngineStats.counters`)."""
        return self.engine.stats().as_dict()

    def _step(self) -> None:
        before = self.stats.get("steps")
        outputs = self.engine.step()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
                if self.on_finish is not None:
                    self.on_finish(out)
            if sink is not None:
                self._send(sink, Event("output", out))
        self._finish_prefixes()
        self.stats = self._snapshot()
        if self.on_stats is not None:
            self.on_stats(self.stats)
        if not outputs and self.stats.get("steps") == before:
            time.sleep(0.001)  # nothing could be scheduled (e.g. waiting for KV): do not spin

    def _finish_prefixes(self) -> None:
        for rid in [r for r in self._prefixes if r not in self.engine.requests]:
            n = self._prefixes.pop(rid)
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                self._send(sink, Event("done", n))

    def _send(self, sink: _Sink, event: Event) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, event)
        except RuntimeError:  # the handler's loop is gone (server shutting down)
            if event.kind == "output" and not event.payload.finished:
                self.engine.abort(event.payload.request_id)
