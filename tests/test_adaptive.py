"""The `adaptive` preset: token-identical to `resident` under random admission / finish / abort
schedules with pools small enough to force reclaim and repopulation mid-generation."""

from __future__ import annotations

import random

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.kv.hier import adaptive as adaptive_mod
from dhisparse.kv.memory.copies import StreamCopyEngine


def make_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def resident() -> LLM:
    return LLM("tiny")


class DelayedStreams:
    """Fake side stream: a copy runs, and its event fires, only after a random number of polls, so
    the residency manager sees completions late and out of order (the worst a side stream does)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def fence(self) -> None:
        return None

    def on_side(self, after, fn) -> list:
        return [self.rng.randrange(0, 4), fn]  # [polls left, copy not yet run]

    def finished(self, ev: list) -> bool:
        if ev[0] > 0:
            ev[0] -= 1
            return False
        if ev[1] is not None:
            ev[1](), ev.__setitem__(1, None)
        return True


@pytest.mark.parametrize("seed,copies", [(0, "sync"), (1, "sync"), (2, "sync"), (0, "delayed"), (1, "delayed")])
def test_adaptive_exact_under_random_load(resident, seed, copies, monkeypatch):
    if copies == "delayed":
        monkeypatch.setattr(adaptive_mod, "copy_engine_for",
                            lambda device, copy, side, copy_many=None: StreamCopyEngine(copy, DelayedStreams(100 + seed), copy_many))
    rng = random.Random(seed)
    page = 16
    llm = LLM("tiny", preset="adaptive", page_size=page, hot_cache_rows=16, debug_checks=True,
              kv_pool_bytes=(52 + 4 * seed) * 6 * page * 40 * 4, admission_reserve_pages=2, repopulate_pages=3)
    eng = llm.engine
    jobs = [(make_prompt(rng, rng.randrange(40, 110)), SamplingParams(max_tokens=rng.randrange(6, 30), ignore_eos=True))
            for _ in range(10)]
    arrivals = sorted(rng.randrange(0, 40) for _ in jobs)
    aborts = {i for i in range(len(jobs)) if rng.random() < 0.2}
    ids, results, step = {}, {}, 0
    while step < 2000 and (len(ids) < len(jobs) or eng.has_unfinished()):
        for i, t in enumerate(arrivals):
            if t == step and i not in ids:
                ids[i] = eng.add_request(*jobs[i])
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        for i in aborts:
            if i in ids and step == arrivals[i] + 5:
                eng.abort(ids[i])
        step += 1
    for i, (prompt, params) in enumerate(jobs):
        if i in aborts and ids[i] not in results:
            continue
        assert results[ids[i]] == resident.generate([prompt], params)[0].token_ids, f"request {i}"
    st = eng.stats().as_dict()
    assert st["reclaimed_pages"] > 0 and st["repopulated_pages"] > 0
    assert st["kv_pages_used"] == 0
    assert eng.store.copies.in_flight() == 0 or copies == "delayed"
    eng.store.check_integrity()


def test_adaptive_keeps_history_resident_at_low_load():
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(90)] for i in range(3)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    ada = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=16)
    his = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16)
    assert [o.token_ids for o in ada.generate(prompts, sp)] == [o.token_ids for o in his.generate(prompts, sp)]
    a, h = ada.engine.stats().as_dict(), his.engine.stats().as_dict()
    assert a["host_fetched_share"] * 5 <= h["host_fetched_share"]
    assert a["resolver_direct_share"] > 0.5


def test_required_state_equals_hisparse():
    from dhisparse.bench.memreport import report

    rows = {(r["preset"], r["context"]): r for r in report()}
    for n in (32768, 102400):
        a, h = rows[("adaptive", n)], rows[("hisparse", n)]
        assert a["device_total"] == h["device_total"]


def test_all_direct_calls_skip_the_resolver():
    """Prompt history resident and every decoded row still in the tail: no resolver call at all."""
    llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=16, debug_checks=True)
    store = llm.engine.store
    calls = []
    plan = store.plan_fn
    store.plan_fn = lambda *a, **k: calls.append(1) or plan(*a, **k)
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(64)] for i in range(2)]  # 4 full pages each
    sp = SamplingParams(max_tokens=8, ignore_eos=True)  # decoded rows stay in the tail page
    ref = [o.token_ids for o in LLM("tiny").generate(prompts, sp)]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    st = llm.engine.stats().as_dict()
    assert not calls and st["resolver_direct_calls"] > 0 and st["resolver_direct_share"] == 1.0


def test_completed_decode_pages_stay_resident_and_resolve_without_any_resolver_work(monkeypatch):
    """While pages are spare, completed tail pages stay on the device as published optional history
    (backed up to host as well), so after many decoded pages every request is still fully covered:
    the pass takes the host-known all-direct path (no resolver call, no direct check, no copy)."""
    from dhisparse.kv.hier import resolver_step

    llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=4, debug_checks=True)
    store = llm.engine.store
    store.plan_fn = lambda *a, **k: pytest.fail("resolver called although every page is published")
    monkeypatch.setattr(resolver_step, "direct_plan", lambda *a: pytest.fail("direct check although the host knew"))
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(30 + 7 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)  # 6 decoded pages of 4 rows each
    ref = [o.token_ids for o in LLM("tiny").generate(prompts, sp)]
    out = llm.generate(prompts, sp)
    assert [o.token_ids for o in out] == ref
    st = llm.engine.stats().as_dict()
    assert st["resolver_direct_share"] == 1.0 and st["host_fetched_share"] == 0.0 and st["resolver_calls"] > 0


def test_pressure_keeps_completed_pages_out_of_the_reserve():
    """With no page beyond the reserve a completed tail page is recycled as under hisparse: same
    tokens, and optional pages never take the reserve (I4)."""
    llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=4, kv_pool_bytes=1 << 17, debug_checks=True)
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(30 + 7 * i)] for i in range(4)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM("tiny").generate(prompts, sp)]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    llm.engine.store.check_integrity()


def test_engine_series_carries_residency_counters():
    from dhisparse.engine.series import SeriesRecorder

    llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=16)
    llm.engine.series = SeriesRecorder(0.01)
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(70)] for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    rows = llm.engine.series.rows
    assert rows and all(k in rows[-1] for k in ("coverage", "host_fetched_share", "running", "alloc_wait_s", "output_tok_s"))
    assert 0.0 <= rows[-1]["coverage"] <= 1.0


def test_backup_ahead_takes_host_copies_off_the_admission_path(resident):
    """Under memory pressure the optional pages are backed up a few per step while they stay
    published: later admissions reclaim them without a copy of their own. Tokens stay exact.
    (Seed 6: prompts whose greedy tokens have no near-tie in the tiny model's logits, so batch
    composition cannot flip them; seed 5 flips request 7 even under batched `resident`.)"""
    rng = random.Random(6)
    jobs = [(make_prompt(rng, rng.randrange(60, 110)), SamplingParams(max_tokens=24, ignore_eos=True)) for _ in range(8)]
    on_admission = {}
    for ahead in (0, 32):
        llm = LLM("tiny", preset="adaptive", page_size=16, hot_cache_rows=16, debug_checks=True,
                  kv_pool_bytes=56 * 6 * 16 * 40 * 4, admission_reserve_pages=2, backup_ahead_pages=ahead)
        store = llm.engine.store
        admitting, issue, admit = [False], store.res.copies.issue, store.admit
        counted = on_admission.setdefault(ahead, [])

        def issue_(kind, req, j, page, issue=issue, counted=counted):
            if kind == "backup" and admitting[0]:
                counted.append(j)
            issue(kind, req, j, page)

        def admit_(*a, admit=admit, **kw):
            admitting[0] = True
            try:
                return admit(*a, **kw)
            finally:
                admitting[0] = False

        store.res.copies.issue, store.admit = issue_, admit_
        ids, out, step = {}, {}, 0
        while step < 1000 and (len(ids) < len(jobs) or llm.engine.has_unfinished()):
            if step % 3 == 0 and len(ids) < len(jobs):
                ids[len(ids)] = llm.engine.add_request(*jobs[len(ids)])
            out.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
            step += 1
        for i, (p, sp) in enumerate(jobs):
            assert out[ids[i]] == resident.generate([p], sp)[0].token_ids, f"request {i}, ahead {ahead}"
        assert llm.engine.stats().as_dict()["reclaimed_pages"] > 0
        store.check_integrity()
    print("admission-path backups", {k: len(v) for k, v in on_admission.items()})
    assert len(on_admission[0]) > 0 and len(on_admission[32]) < len(on_admission[0])


def test_ready_map_writes_are_batched_and_the_last_change_wins():
    """Publications are applied in one batched write when the ready map is next read; a page
    unpublished after its publication (or the reverse) ends as its last change says."""
    import torch

    llm = LLM("tiny", preset="adaptive", page_size=4, hot_cache_rows=16)
    eng = llm.engine
    rid = eng.add_request(list(range(3, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    store, ps = eng.store, 4
    slot = store.reqs[rid].slot
    before = store.opt_loc.clone()
    store._publish(rid, 20, 5)
    store._unpublish(rid, 20)
    store._publish(rid, 21, 7)
    store._unpublish(rid, 0)
    store._publish(rid, 0, 9)
    assert len(store._pending_map) == 3 and torch.equal(store._opt_loc, before)  # nothing written yet
    m = store.opt_loc  # the read applies them
    assert not store._pending_map
    assert (m[slot, 20 * ps : 21 * ps] == -1).all()
    assert m[slot, 21 * ps : 22 * ps].tolist() == [7 * ps + o for o in range(ps)]
    assert m[slot, 0:ps].tolist() == [9 * ps + o for o in range(ps)]


def test_batched_copies_merge_adjacent_pages_and_stay_exact(resident, monkeypatch):
    """The side stream's batches copy runs of pages consecutive on both sides as one copy
    (`AdaptiveKV.copy_pages`); under the delayed, out-of-order fake stream the tokens stay equal
    to resident serving, and runs longer than one page do occur (so the merged path is tested)."""
    counts = []
    from dhisparse.kv.hier import tail as tail_mod  # AdaptiveKV.copy_pages -> HierarchicalKV._copy_runs -> tail.copy_runs

    real = tail_mod.page_runs

    def recording(pairs):
        runs = real(pairs)
        counts.extend(r.count for r in runs)
        return runs

    monkeypatch.setattr(tail_mod, "page_runs", recording)
    test_adaptive_exact_under_random_load(resident, 0, "delayed", monkeypatch)
    assert counts and max(counts) > 1


@pytest.mark.parametrize("prompt_lens", [(30, 37, 44), (3, 200, 9)])
def test_host_counted_direct_passes_equal_the_device_census(prompt_lens, monkeypatch):
    """An all-direct decode pass is counted on the host (min(k, n) selected rows a request, one
    wholly direct call a group); the totals equal the per-group device counters'. Histories
    shorter and longer than k (tiny: k = 16) both occur."""
    from dhisparse.kv.hier import context as hier_context

    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate(prompt_lens)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    stats = {}
    for host in (False, True):
        monkeypatch.setattr(hier_context.HierContext, "HOST_CENSUS", host)
        llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=4)
        outs = llm.generate(prompts, sp)
        st = llm.engine.stats().as_dict()
        stats[host] = ([o.token_ids for o in outs], {k: v for k, v in st.items() if k.startswith(("resolver", "selected", "host_"))})
    assert stats[True] == stats[False]
    assert stats[True][1]["resolver_direct_calls"] > 0


def test_no_repopulation_while_an_admission_waits_for_memory(resident):
    """A page refilled while an admission lacks memory would be reclaimed for it: in a step whose
    admission attempt failed for memory no repopulation starts. Tokens stay exact."""
    rng = random.Random(6)
    jobs = [(make_prompt(rng, rng.randrange(60, 110)), SamplingParams(max_tokens=24, ignore_eos=True)) for _ in range(8)]
    llm = LLM("tiny", preset="adaptive", page_size=16, hot_cache_rows=16, debug_checks=True,
              kv_pool_bytes=56 * 6 * 16 * 30 * 4, admission_reserve_pages=2)
    store = llm.engine.store
    events, issue, admit = [], store.res.copies.issue, store.admit
    store.res.copies.issue = lambda kind, *a: events.append(kind) or issue(kind, *a)
    store.admit = lambda *a, **k: admit(*a, **k) or events.append("failed") or False
    ids, out, steps = {}, {}, []
    for step in range(400):
        if len(ids) < len(jobs) and step % 3 == 0:
            ids[len(ids)] = llm.engine.add_request(*jobs[len(ids)])
        events.clear()
        out.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
        steps.append(list(events))
        if len(out) == len(jobs):
            break
    assert [out[ids[i]] for i in range(len(jobs))] == [resident.generate([p], sp)[0].token_ids for p, sp in jobs]
    assert any("failed" in s for s in steps) and any("populate" in s for s in steps)
    assert not any("failed" in s and "populate" in s for s in steps)


def test_kept_tail_pages_never_spend_the_requests_reservation():
    """A completed tail page kept as optional history is replaced in the tail by a page beyond
    the reservations: the request's own reservation still covers every required page it will
    need (index pages as it grows), so a running request never meets an exhausted pool."""
    llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=4, kv_pool_bytes=1 << 19, debug_checks=True)
    eng, store = llm.engine, llm.engine.store
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(20 + 7 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=120, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    kept = 0
    while eng.has_unfinished():
        kept = max(kept, sum(len(store.pool.owned_by(("opt", r))) for r in ids))
        eng.step()
        for rid in ids:
            if rid not in store.reqs or not store.reqs[rid].decoding:
                continue
            need = store.arena.index_pages_for(store.max_total[rid]) - len(store.resident.index_tables[rid])
            assert store.pool._reserved.get(rid, 0) >= need, f"{rid}: reservation spent on kept tail pages"
    assert kept > 0  # pages were kept (the path under test ran)


def test_default_reserve_and_a_request_that_only_the_reserve_blocks():
    """M_res by default is one request's lifelong pages at max_model_len (hot cache, tail, index
    history), at most an eighth of the pool; a request that fits the pool only by eating into the
    reserve is refused at once, naming the reserve."""
    llm = LLM("tiny", preset="adaptive", kv_pool_bytes=4 << 20, max_model_len=512, hot_cache_rows=16)
    store = llm.engine.store
    want = min(store.required_pages(512), store.pool.capacity // 8)
    assert store.res.reserve == want > 0
    explicit = LLM("tiny", preset="adaptive", kv_pool_bytes=4 << 20, max_model_len=512, hot_cache_rows=16,
                   admission_reserve_pages=0).engine.store
    assert explicit.res.reserve == 0
    total = next(t for t in range(16, 100_000, 16) if store.pages_for(t, t) > store.pool.capacity - store.res.reserve)
    assert store.pages_for(total, total) <= store.pool.capacity  # it would fit the pool without the reserve
    msg = store.never_fits(total, total)
    assert msg is not None and "admission reserve" in msg and explicit.never_fits(total, total) is None


def test_decode_pages_hot_cache_is_the_papers_rule():
    """--decode-pages hot-cache (the paper's rule): completed decode pages are recycled as under
    hisparse, so optional history holds prompt pages only and the decode rows come back through the
    hot cache; tokens equal resident's. `optional` (ours) keeps them (the test above)."""
    prompts = [[3 + (5 * i + 3 * j) % 250 for j in range(30 + 7 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in LLM("tiny").generate(prompts, sp)]
    kept = {}
    for mode in ("optional", "hot-cache"):
        llm = LLM("tiny", preset="adaptive", hot_cache_rows=16, page_size=4, debug_checks=True, decode_pages=mode)
        res = llm.engine.store.res
        pages = []
        original = res.keep
        res.keep = lambda req, j, page, _o=original: (pages.append(j), _o(req, j, page))[1]
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
        kept[mode] = len(pages)
    assert kept["optional"] > 0 and kept["hot-cache"] == 0
    with pytest.raises(ValueError, match="decode_pages"):
        LLM("tiny", preset="adaptive", decode_pages="sometimes")
