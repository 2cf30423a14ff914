"""A speculative round's end in the step (step 7 of docs/structure.md, paper eq. 7): the drafts of
every verification chunk judged against exactly the distribution the Sampler samples from, the
committed frontier moved to n + 1 + A, the grammar settled, and the drafter's commits of the
round made at once (`SpecRuntime.commit_all`). A request whose grammar or drafter commit fails
fails alone."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from dhisparse.core.logits import History, apply_processors, needs_history, token_logprobs
from dhisparse.engine.finish import fail
from dhisparse.engine.request import RequestOutput
from dhisparse.engine.scheduler import Chunk
from dhisparse.spec.verify import row_history

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def verify(eng: Engine, verifying: list[tuple[Chunk, int, int]], hidden: torch.Tensor):
    """Accept drafts; the committed frontier becomes n + 1 + A (eq. 7)."""
    if not verifying:
        return []
    rows = [i for _, a, b in verifying for i in range(a, b)]
    if rows != list(range(hidden.shape[0])):  # a verification-only pass uses every row, in order
        hidden = hidden.index_select(0, torch.tensor(rows).to(hidden.device, non_blocking=True))
    raw = eng.model.logits(hidden)
    consumed: dict[str, int] = {}
    accs = eng.spec.verify(verifying, processed_verify_logits(verifying, raw, consumed))
    off = 0
    for (c, a, b), acc in zip(verifying, accs):
        c.req.num_computed = c.start + acc.committed
        if c.req.matcher is not None:  # rejected drafts rolled back, the bonus consumed
            try:
                c.req.matcher.settle(consumed[c.req.request_id], acc.accepted, acc.bonus)
            except Exception as e:  # noqa: BLE001 - that request alone fails (reported before the commit)
                eng._failed[c.req.request_id] = f"grammar: {type(e).__name__}: {e}"
        k = c.req.params.logprobs
        if k is not None:
            rows = raw[off : off + len(acc.emitted)]
            eng._verify_lps[c.req.request_id] = token_logprobs(rows, acc.emitted, [k] * len(acc.emitted))
        off += b - a
    return accs


def processed_verify_logits(verifying, raw: torch.Tensor, consumed: dict[str, int]) -> torch.Tensor:
    """Verification rows through the requests' logit processors (core/logits.py): row i of a
    chunk [anchor, d_1..] sees the output so far + d_1..d_i, as decoding one token at a time
    would, and the grammar mask after d_1..d_i (`Matcher.round_masks`; `consumed`: drafts the
    matcher took, rolled back in `verify`); the verifier then judges drafts against exactly
    what the Sampler samples from."""
    if not any(needs_history(c.req.params) for c, _, _ in verifying):
        return raw
    params, hist = [], []
    for c, a, b in verifying:
        r, masks = c.req, None
        if r.matcher is not None:
            masks, consumed[r.request_id] = r.matcher.round_masks(c.tokens[1:])
        h = History(r.prompt_ids, r.output_ids, r.eos) if needs_history(r.params) else None
        params.extend([r.params] * (b - a))
        hist.extend(row_history(h, c.tokens[1:], masks))
    return apply_processors(raw, params, hist)


def commit(eng: Engine, verifying, accs, captured) -> list[RequestOutput]:
    """The drafter commits of a round at once; a request whose commit fails fails alone (an
    AssertionError, a violated invariant or debug check, is never a request's fault: it propagates)."""
    now, outs = time.perf_counter(), []
    if not verifying:
        return outs
    errors = eng.spec.commit_all([(c, acc, a) for (c, a, _), acc in zip(verifying, accs)], captured)
    for ((c, _, _), acc), e in zip(zip(verifying, accs), errors):
        if e is not None:  # that request's drafter state: it alone fails
            outs.append(fail(eng, c.req, f"drafter commit failed: {type(e).__name__}: {e}"))
            continue
        outs.append(eng._append_tokens(c.req, acc.emitted, now, eng._verify_lps.get(c.req.request_id)))
    return outs
