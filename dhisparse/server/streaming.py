"""Waiting on engine events: collect a whole response, or stream it as SSE chunks.

Both paths abort the engine request whenever they end early - the client went away, the
handler was cancelled, the request ran past its timeout, or the connection stalled (the client
stopped reading; connection.py) - so its KV pages are freed, and count the abort by reason in
/metrics. A request the server aborts (shutdown) ends properly: a stream with an abort chunk
(finish_reason "abort"), its usage chunk if asked for, and `data: [DONE]`; a non-streamed request
with a JSON 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

import anyio
from starlette.responses import StreamingResponse

from dhisparse.engine.request import RequestOutput
from dhisparse.server.connection import STALLED_KEY
from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.responses import SSE_DONE, Formatter, Sub, sse
from dhisparse.server.worker import Event

if TYPE_CHECKING:
    from dhisparse.server.state import ServerState

log = logging.getLogger("dhisparse.server")
POLL_S = 0.5  # how often a non-streamed request checks whether its client is still there


def _raise_for(ev: Event, state: "ServerState") -> None:
    if ev.kind == "failed":
        raise engine_failed(state, ev.payload)
    if ev.kind == "aborted":
        raise ApiError("request aborted: the server is shutting down", status=503, type_="server_error",
                       code="aborted")


def engine_failed(state: "ServerState", message: str) -> ApiError:
    """The error of requests in flight when the engine thread failed: 503 when a data-parallel
    rank was lost (the server cannot serve; retry on another replica), else 500."""
    if state.worker.error_status == 503:
        return ApiError(message, status=503, type_="server_error", code="rank_lost")
    return ApiError(message, status=500, type_="server_error", code="engine_failed")


def request_failed(out) -> ApiError:
    """The 500 of a request whose own work failed in the engine (finish_reason "error"): the
    engine aborted it alone and serves on."""
    return ApiError(f"the request failed in the engine: {out.error or 'unknown error'}", status=500,
                    type_="server_error", code="request_failed")


def _gone_reason(state: "ServerState") -> str:
    return "client_disconnect" if state.accepting else "shutdown"


async def next_event(q: asyncio.Queue, state: "ServerState", rid: str, timeout: float | None = None) -> Event:
    """The next event of `rid`; failures and server-side aborts raise ApiError (5xx)."""
    try:
        ev = await asyncio.wait_for(q.get(), timeout or state.config.request_timeout_s)
    except asyncio.TimeoutError:
        state.abort(rid, "timeout")
        raise ApiError(f"request timed out after {state.config.request_timeout_s:.0f} s; raise --request-timeout",
                       status=504, type_="server_error", code="timeout") from None
    except asyncio.CancelledError:
        state.abort(rid, _gone_reason(state))
        raise
    if ev.kind == "aborted":
        state.metrics.observe_aborted("shutdown")
    _raise_for(ev, state)
    return ev


async def collect(request, q: asyncio.Queue, state: "ServerState", rid: str,
                  logprobs: list | None = None) -> RequestOutput:
    """Wait for the final output; aborts the request if the client disconnects or time runs out.
    `logprobs`: a list to extend with every report's logprobs (each report has only its new ones)."""
    deadline = time.monotonic() + state.config.request_timeout_s
    next_check = time.monotonic() + POLL_S
    reason = None  # why the engine request must be aborted when this returns; None: it ended
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                reason = "timeout"
                raise ApiError("request timed out; raise --request-timeout", status=504, type_="server_error",
                               code="timeout")
            if now >= next_check:  # outputs may arrive every step, so check by the clock, not on idle
                next_check = now + POLL_S
                if await request.is_disconnected():
                    reason = "stall" if request.scope.get("state", {}).get(STALLED_KEY) else "client_disconnect"
                    raise ApiError("client disconnected", status=499, code="client_disconnected")
            reason = _gone_reason(state)  # if cancelled while waiting
            try:
                ev = await asyncio.wait_for(q.get(), min(POLL_S, deadline - now))
            except asyncio.TimeoutError:
                continue
            reason = None
            if ev.kind == "aborted":
                state.metrics.observe_aborted("shutdown")
            _raise_for(ev, state)
            if ev.kind == "output":
                if logprobs is not None and ev.payload.logprobs:
                    logprobs.extend(ev.payload.logprobs)
                if ev.payload.finished:
                    if ev.payload.finish_reason == "error":
                        raise request_failed(ev.payload)
                    return ev.payload
    finally:
        if reason is not None:
            state.abort(rid, reason)


class StreamContext:
    """Shared by a stream's body generator and its response: why the stream stopped early."""

    def __init__(self) -> None:
        self.reason = "client_disconnect"


async def _forward(i: int, q: asyncio.Queue, merged: asyncio.Queue) -> None:
    """Copy one engine request's events onto the stream's merged queue, tagged with its position."""
    while True:
        ev = await q.get()
        merged.put_nowait((i, ev))
        if ev.kind != "output" or ev.payload.finished:
            return


async def stream_events(subs: "list[tuple[Sub, asyncio.Queue]]", state: "ServerState", fmt: Formatter,
                        include_usage: bool, ctx: StreamContext | None = None) -> AsyncIterator[str]:
    """SSE chunks of every choice (interleaved as the engine reports them, each tagged with its
    index) until all finish, then an optional usage chunk and `[DONE]`. Closing the generator early
    (client gone, stalled, timed out) aborts every unfinished engine request."""
    ctx = ctx or StreamContext()
    merged: asyncio.Queue = asyncio.Queue()
    live = {s.request_id for s, _ in subs}
    last: dict[str, RequestOutput | None] = {s.request_id: None for s, _ in subs}
    tracks = {s.request_id: fmt.track() for s, _ in subs}
    tasks = [asyncio.create_task(_forward(i, q, merged)) for i, (_, q) in enumerate(subs)]
    deadline = time.monotonic() + state.config.request_timeout_s
    try:
        for sub, _ in subs:
            first = fmt.first_chunk(sub.index)
            if first is not None:
                yield sse(first)
        while live:
            try:
                i, ev = await asyncio.wait_for(merged.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                ctx.reason = "timeout"
                yield sse(ApiError("request timed out; raise --request-timeout", status=504, type_="server_error",
                                   code="timeout").body())
                break
            sub = subs[i][0]
            rid = sub.request_id
            if ev.kind == "output":
                out = last[rid] = ev.payload
                if out.finished:
                    live.discard(rid)
                if out.finished and out.finish_reason == "error":
                    yield sse(request_failed(out).body())
                elif (chunk := fmt.output_chunk(sub, out, tracks[rid])) is not None:
                    yield sse(chunk)
            elif ev.kind == "aborted":
                live.discard(rid)
                state.metrics.observe_aborted("shutdown")
                yield sse(fmt.chunk("", "abort", index=sub.index))
            elif ev.kind == "failed":
                live.discard(rid)
                yield sse(engine_failed(state, ev.payload).body())
        if include_usage:
            yield sse(fmt.usage_chunk([last[s.request_id] for s, _ in subs], [s for s, _ in subs]))
        yield SSE_DONE
    finally:
        for t in tasks:
            t.cancel()
        for rid in live:
            state.abort(rid, ctx.reason if state.accepting else "shutdown")


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client's disconnect (whatever the ASGI
    spec version) and closes its body generator when streaming stops, so the generator's
    `finally` runs at once and aborts the engine request."""

    def __init__(self, content, ctx: StreamContext | None = None, **kw) -> None:
        super().__init__(content, **kw)
        self.ctx = ctx or StreamContext()

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def run_stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        log.debug("client went away while streaming")
                    tg.cancel_scope.cancel()

                tg.start_soon(run_stream)
                await self.listen_for_disconnect(receive)
                if scope.get("state", {}).get(STALLED_KEY):
                    self.ctx.reason = "stall"
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
