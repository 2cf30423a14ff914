"""What admission starts for a request (steps 2-3 of docs/structure.md), called by the scheduler
(`Scheduler(on_admit=...)`) for each request it admits: the drafter's state for it, the
allocation-wait counters, the import of its matched prefix (whole pages where the store has a
page layout), and for an arrived prompt of disaggregation its first token (engine/handoff.py).
A failure here is that request's alone: recorded, and reported after the schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dhisparse.engine.handoff import report_first_token
from dhisparse.engine.prefixes import prefix_match
from dhisparse.engine.request import Request

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def on_admit(eng: Engine, req: Request) -> None:
    """A request was admitted: its drafter state and prefix import. A failure here is that
    request's alone (reported after the schedule, `finish.fail_pending`)."""
    try:
        _admitted_work(eng, req)
    except AssertionError:  # a violated invariant or debug check: never a request's own fault
        raise
    except Exception as e:  # noqa: BLE001 - one request's failure aborts it alone
        eng._failed[req.request_id] = f"admission failed: {type(e).__name__}: {e}"


def _admitted_work(eng: Engine, req: Request) -> None:
    if eng.spec is not None:
        eng.spec.admit(req.request_id)
    eng._admitted += 1
    eng._alloc_wait += (req.admitted_at or req.arrival) - req.arrival
    item, n = prefix_match(eng, req.request_id)
    eng._matches.pop(req.request_id, None)
    n = eng.store.import_len(item, n) if item is not None else 0  # V4: whole prefixes only
    if n > 0:
        eng.store.import_prefix(req.request_id, item, n)  # whole pages where the store has a page layout
        req.num_computed = req.imported_len = n
        if eng.spec is not None:
            eng.spec.observe_import(req.request_id, item, n)
    report_first_token(eng, req)
