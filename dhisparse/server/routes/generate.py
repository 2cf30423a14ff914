"""Generation shared by /v1/completions and /v1/chat/completions: a request's choices as engine
requests (`make_subs`: best_of per prompt, choice i seeded seed + i), submitted together (a rejection
is a 400 and the others are aborted), then streamed over SSE or collected into one response
(best_of > n: the n of highest cumulative logprob per prompt)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from fastapi.responses import JSONResponse

from dhisparse.server.protocol.common import CommonRequest
from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.protocol.sampling import seeded
from dhisparse.server.responses import Formatter, Sub
from dhisparse.server.state import ServerState
from dhisparse.server.streaming import AbortingStreamingResponse, StreamContext, collect, next_event, stream_events


def make_subs(rid: str, prepared: list, n: int, best_of: int, report: bool, echo: bool = False,
              echo_only: bool = False) -> list[Sub]:
    """best_of engine requests per prompt (n of them are returned); request i of a prompt uses
    seed + i (`seeded`). best_of > n ranks by cumulative logprob, so logprobs are computed."""
    subs = []
    for pi, (ids, params) in enumerate(prepared):
        if best_of > n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)
        for j in range(best_of):
            subs.append(Sub(pi * best_of + j, f"{rid}-{pi}-{j}", ids, seeded(params, j), pi, echo, echo_only, report))
    return subs


class _Connected:
    """Stands in for the request in all but one of an HTTP request's `collect`s: one poller of
    the client's disconnect is enough (they are all cancelled together)."""

    scope: dict = {}

    async def is_disconnected(self) -> bool:
        return False


async def generate(request: Request, state: ServerState, subs: list[Sub], fmt: Formatter, body: CommonRequest,
                   param: str, n: int = 1):
    """Submit the engine requests; a rejection is a 400 (the others are aborted); then stream or
    collect their outputs (best_of > n: the n with the highest cumulative logprob per prompt)."""
    qs: list[tuple[Sub, asyncio.Queue]] = []
    try:
        for sub in subs:
            qs.append((sub, state.worker.submit(sub.request_id, sub.prompt_ids, sub.params)))
        for sub, q in qs:
            ev = await next_event(q, state, sub.request_id)
            if ev.kind == "error":
                raise ApiError(ev.payload, param=param)
    except BaseException:
        for sub, _ in qs:
            state.worker.abort(sub.request_id)
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        ctx = StreamContext()
        gen = stream_events(qs, state, fmt, include_usage, ctx)
        return AbortingStreamingResponse(gen, ctx, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    lps: list[list] = [[] for _ in qs]
    tasks = [asyncio.ensure_future(collect(request if k == 0 else _Connected(), q, state, sub.request_id, lps[k]))
             for k, (sub, q) in enumerate(qs)]
    try:
        outs = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    picked = _best(subs, outs, lps, n)
    return JSONResponse(fmt.response([outs[k] for k in picked], [subs[k] for k in picked],
                                     all_logprobs=[lps[k] for k in picked]))


def _best(subs: list[Sub], outs: list, lps: list[list], n: int) -> list[int]:
    """Positions of the choices to return: every one, or per prompt the n of highest cumulative
    logprob (ties by order), re-indexed prompt * n + rank."""
    per = len(subs) // (max(s.prompt_index for s in subs) + 1)
    if per == n:
        return list(range(len(subs)))
    picked = []
    for pi in range(len(subs) // per):
        ks = sorted(range(pi * per, (pi + 1) * per), key=lambda k: -sum(lp.logprob for lp in lps[k]))[:n]
        for rank, k in enumerate(ks):
            subs[k] = dataclasses.replace(subs[k], index=pi * n + rank)
        picked += ks
    return picked
