"""How a request ends (step 8 of docs/structure.md): finished (its pages, host rows, slot and
drafter state freed), aborted by its caller, or failed alone.

Failure isolation: a failure in one request's own work (admission, sampling, KV upkeep, the
drafter commit, the stop checks) is recorded in `Engine._failed` (request id -> why) where it
happens and reported by `fail_pending` once the phase is over, or reported at once with `fail`;
the request finishes with finish_reason "error" and the others are unaffected. An
AssertionError (a violated invariant or debug check) is never a request's fault: callers let it
propagate.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dhisparse.engine.request import Request, RequestOutput, Status

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine

log = logging.getLogger("dhisparse.engine")


def finish(eng: Engine, req: Request, reason: str) -> None:
    """End `req` with `reason`: the scheduler frees its KV and slot; the engine forgets its prefix
    match, its arrived prompt, its drafter state and its replayed reference."""
    eng.scheduler.finish(req, reason)
    eng.requests.pop(req.request_id, None)
    eng._matches.pop(req.request_id, None)
    eng._arrived.pop(req.request_id, None)
    if eng.spec is not None:
        eng.spec.release(req.request_id)
    if eng.replay is not None:
        eng.replay.forget(req.request_id)


def abort(eng: Engine, request_id: str) -> bool:
    """Abort a waiting or running request and free its KV; False if unknown/finished."""
    req = eng.requests.pop(request_id, None)
    eng._keeping.pop(request_id, None)
    if req is None or req.status is Status.FINISHED:
        return False
    finish(eng, req, "abort")
    return True


def fail(eng: Engine, req: Request, msg: str) -> RequestOutput:
    """Finish `req` with finish_reason "error" (its KV freed) and report it."""
    log.warning("request %s failed: %s", req.request_id, msg)
    req.error = msg
    eng._keeping.pop(req.request_id, None)
    finish(eng, req, "error")
    pieces = req.stop.pieces
    return RequestOutput(req.request_id, [], "", True, "error", req.metrics(), req.output_ids, len(req.output_ids),
                         pieces, len(pieces), error=msg)


def fail_pending(eng: Engine) -> list[RequestOutput]:
    """Report (and finish) every request whose failure was recorded since the last call."""
    failed, eng._failed = eng._failed, {}
    return [fail(eng, eng.requests[r], m) for r, m in failed.items() if r in eng.requests]
