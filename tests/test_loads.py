"""Background loads (kv/memory/loads.py): prefix imports and hand-off backups beside the batch.

On CPU the copies are synchronous; here a fake stream whose events fire late stands in for the
side stream, so the contract is tested: a loading request is never scheduled, hand-off pages stay
held until their copy is done, a retired request's loads are settled, and tokens stay exact.
"""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.kv.memory.loads import StreamLoads, SyncLoads
from dhisparse.kv.memory.prefix_store import to_pages
from kv_check import checked

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


class LateStreams:
    """Fake `Streams`: a side "copy" runs at once (its data is visible), its event fires only
    after `delay` queries, or when the compute stream is made to wait for it."""

    def __init__(self, delay: int, log: list | None = None) -> None:
        self.delay, self.log = delay, log

    def fence(self) -> None:
        return None

    def on_side(self, after, fn) -> list:
        fn()
        return [self.delay, False]  # [queries left, waited for]

    def finished(self, ev: list) -> bool:
        ev[0] -= 1
        return ev[0] < 0 or ev[1]

    def wait(self, ev: list) -> None:
        ev[1] = True
        if self.log is not None:
            self.log.append(ev)


def late_loads(delay: int, log: list | None = None) -> StreamLoads:
    return StreamLoads(streams=LateStreams(delay, log))


def test_stream_loads_wait_for_their_event_and_run_on_done_once():
    done, copied = [], []
    loads = late_loads(delay=2)
    loads.run("a", lambda: copied.append("a"), on_done=lambda: done.append("a"))
    assert copied == ["a"]  # enqueued at issue
    assert loads.loading("a") and loads.loading("a")  # two queries: not yet
    assert not loads.loading("a") and done == ["a"]
    loads.poll()
    assert done == ["a"] and loads.pending == 0


def test_settle_orders_the_compute_stream_after_the_loads():
    waited, done = [], []
    loads = late_loads(delay=100, log=waited)
    loads.run("a", lambda: None, on_done=lambda: done.append(1))
    loads.run("a", lambda: None)
    loads.settle("a")
    assert len(waited) == 2 and done == [1] and not loads.loading("a")


def test_sync_loads_are_never_pending():
    done = []
    loads = SyncLoads()
    loads.run("a", lambda: None, on_done=lambda: done.append(1))
    assert done == [1] and not loads.loading("a") and loads.pending == 0


@pytest.mark.parametrize("n,per", [(0, 4), (1, 4), (7, 4), (8, 4), (9, 3)])
def test_to_pages_lays_out_positions_page_by_page(n, per):
    rows = torch.randn(3, n, 5)
    pages = to_pages(rows, per, pin=False)
    assert pages.shape == (-(-n // per), 3, per, 5)
    for t in range(n):
        assert torch.equal(pages[t // per, :, t % per], rows[:, t])
    if n % per:
        assert not pages[-1, :, n % per :].any()  # zero padding


def _watch(llm: LLM, delay: int) -> list[str]:
    """Late loads on the engine's store; every step asserts nothing loading was scheduled and the
    pool's pages all add up. Returns the log of (request, phase) where a load held a request."""
    eng, store = llm.engine, llm.engine.store
    res = getattr(store, "resident", store)
    res.loads = late_loads(delay)
    if hasattr(store, "handoffs"):
        store.handoffs = late_loads(delay)
    held: list[str] = []
    orig = eng.scheduler.schedule

    def schedule():
        chunks = orig()
        for req in eng.scheduler.running:
            if store.loading(req.request_id):
                held.append(req.request_id)
        assert not any(store.loading(c.req.request_id) for c in chunks), "a loading request was scheduled"
        store.check_integrity()
        return chunks

    eng.scheduler.schedule = schedule
    return held


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_late_loads_keep_tokens_exact(preset):
    prefix = [3 + (5 * j) % 97 for j in range(45)]
    reqs = [prefix + [50 + i] for i in range(3)]
    ref = [o.token_ids for o in LLM("tiny").generate(reqs, GREEDY)]
    llm = checked(LLM("tiny", preset=preset, hot_cache_rows=16, page_size=8, debug_checks=True))
    llm.prepare_prefix(prefix)
    held = _watch(llm, delay=3)
    outs = llm.generate(reqs, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert held  # the imports (and hisparse's hand-offs) did hold requests back
    assert llm.engine.stats().as_dict()["kv_pages_used"] == 0  # hand-off pages freed once done


def test_handoff_pages_are_held_until_their_copy_is_done():
    prompt = [3 + (5 * j) % 97 for j in range(45)] + [9]
    llm = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=8)  # no stored prefix: nothing borrowed
    eng, store = llm.engine, llm.engine.store
    store.handoffs = late_loads(delay=50)
    rid = eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # the prompt's prefill + the hand-off
    held = store.pool.owned_by(("handoff", rid))
    assert len(held) == 46 // 8  # complete prompt pages wait for their backup
    assert store.loading(rid)
    assert eng.step() == []  # nothing else to run: the request waits for its history on host
    store.handoffs.settle(rid)
    assert not store.pool.owned_by(("handoff", rid)) and not store.loading(rid)


def test_abort_while_loading_settles_the_load():
    prefix = [3 + (5 * j) % 97 for j in range(45)]
    llm = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=8)
    llm.prepare_prefix(prefix)
    eng, store = llm.engine, llm.engine.store
    store.resident.loads = late_loads(delay=1000)
    rid = eng.add_request(prefix + [9], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # admitted, import in flight: nothing runs
    assert store.loading(rid)
    assert eng.abort(rid)
    assert store.resident.loads.pending == 0
    store.check_integrity()
    assert eng.stats().as_dict()["kv_pages_used"] == 0
