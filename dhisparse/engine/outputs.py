"""New tokens into a step's report (step 7 of docs/structure.md): each token through the request's
stop checks and incremental detokenizer (`engine/stops.py`), one `RequestOutput` per request
and step. Tokens after a stop are dropped; a failure in the stop checks or the detokenizer fails
that request alone (`engine/finish.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dhisparse.core.logits import TokenLogprob
from dhisparse.engine.finish import fail, finish
from dhisparse.engine.request import Request, RequestOutput, Status

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def append_tokens(eng: Engine, req: Request, toks: list[int], now: float,
                  logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """Append tokens through the stop checks; tokens after a stop are dropped. A failure in the
    stop checks or detokenizer fails this request alone. `logprobs`: one per token (or None)."""
    try:
        return _append_checked(eng, req, toks, now, logprobs)
    except AssertionError:  # a violated invariant or debug check: never a request's own fault
        raise
    except Exception as e:  # noqa: BLE001
        return fail(eng, req, f"stop check failed: {type(e).__name__}: {e}")


def _append_checked(eng: Engine, req: Request, toks: list[int], now: float,
                    logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    new, delta = [], ""
    if req.first_token_at is None:
        req.first_token_at = now
    for tok in toks:
        req.output_ids.append(tok)
        new.append(tok)
        eng._generated += 1
        upd = req.stop.update(tok)
        delta += upd.text_delta
        if upd.finished:
            finish(eng, req, upd.reason)
            break
    pieces = req.stop.pieces
    return RequestOutput(req.request_id, new, delta, req.status is Status.FINISHED, req.finish_reason,
                         req.metrics(), req.output_ids, len(req.output_ids), pieces, len(pieces),
                         logprobs=None if logprobs is None else logprobs[: len(new)],
                         prompt_logprobs=req.prompt_logprobs)
