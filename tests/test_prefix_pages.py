"""Shared prefix host pages (kv/hier/prefix_pages.py, HostStore.share / borrow): a request importing a
stored prefix borrows the prefix's host pages instead of backing its imported rows up again.

Checked: the host store's bookkeeping (unit and property-based), that a hisparse importer hands
off no borrowed page and does not wait, that adaptive never backs a borrowed page up (fewer
backups than with private copies), that nothing writes a shared page, that the host reservation
shrinks so more importers fit a small host pool, the fallback when the pool has no room, and
that tokens stay exact (I2 checked on every location)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.hier.prefix_pages import PrefixPages
from kv_check import checked
from test_adaptive import DelayedStreams

PREFIX = [3 + (5 * j) % 97 for j in range(100)]  # 6 complete pages of 16, and a partial one
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def _reqs(n: int) -> list[list[int]]:
    return [PREFIX + [50 + i, 7 + i] for i in range(n)]


def _host(pages: int = 12) -> HostStore:
    return HostStore(pages, 2, 4, 3, torch.float32, pin=False)


def test_host_store_shares_once_and_borrowers_own_only_the_rest():
    host, fills = _host(), []
    assert host.admit("a", 4 * 5) and host.pool.num_reserved == 5
    pages = host.share("p", 3, fills.append)
    assert host.share("p", 3, fills.append) == pages and fills == [pages]  # written once
    assert host.borrow("a", "p", 2) == 2 and host.pool.num_reserved == 3  # reservation shrinks by 2
    host.ensure("a", 4 * 5)
    assert host.tables["a"][:2] == pages[:2] and host.borrowed_pages("a") == 2
    assert sorted(host.pool.owned_by("a")) == sorted(host.tables["a"][2:])
    host.check_integrity()
    with pytest.raises(RuntimeError, match="already has host pages"):
        host.borrow("a", "p", 1)
    host.free("a")
    assert host.pool.owned_by(("shared", "p")) == pages and all(host.is_shared(p) for p in pages)
    host.check_integrity()


def test_share_refuses_pages_promised_to_reservations():
    host = _host(6)
    assert host.admit("a", 4 * 5)  # 5 of 6 pages reserved
    assert host.share("p", 2, lambda pages: None) is None
    assert host.borrow("a", "p", 2) == 0 and host.tables["a"] == []


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["admit", "borrow", "grow", "free"]), hs.integers(0, 3),
                          hs.integers(1, 24)), max_size=40))
def test_host_store_bookkeeping_holds_under_any_sequence(ops):
    """Property: after any admit / borrow / grow / free sequence the pool's integrity holds,
    shared pages stay owned by their key, and no request owns a page it borrowed."""
    host = _host(16)
    shared = host.share("p", 3, lambda pages: None)
    for op, r, n in ops:
        if op == "admit" and r not in host.tables:
            host.admit(r, n)
        elif op == "borrow" and r in host.tables and not host.tables[r]:
            host.borrow(r, "p", n // 4)
        elif op == "grow" and r in host.tables:
            have = len(host.tables[r]) * 4
            if host.pool.available + host.pool._reserved.get(r, 0) >= -(-n // 4) - len(host.tables[r]):
                host.ensure(r, max(have, n))
        elif op == "free":
            host.free(r)
        host.check_integrity()
        assert host.pool.owned_by(("shared", "p")) == shared
        for req in host.tables:
            assert not set(host.pool.owned_by(req)) & set(shared)


def test_hisparse_importer_borrows_and_hands_off_nothing():
    llm = checked(LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16, debug_checks=True))
    llm.prepare_prefix(PREFIX)
    eng, store = llm.engine, llm.engine.store
    rid = eng.add_request(_reqs(1)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()  # import + the suffix's prefill + the hand-off
    assert store.host.borrowed_pages(rid) == 100 // 16
    assert not store.pool.owned_by(("handoff", rid)) and not store.loading(rid)
    key, _ = store.host.borrowed[rid]
    paged = eng.prefixes.match(_reqs(1)[0])[0].paged(16, store.arena.index_page_size)
    shared = store.host.shared[key]
    assert torch.equal(store.host.rows[shared], paged.latent[: len(shared)])  # the very bytes imported
    store.check_integrity()


@pytest.mark.parametrize("preset,copies", [("hisparse", "sync"), ("adaptive", "sync"), ("adaptive", "delayed")])
def test_importers_stay_exact_and_back_up_fewer_pages(preset, copies, monkeypatch):
    """Same tokens as resident with and without sharing; with it no borrowed page is ever backed
    up (the copy would raise), and fewer pages go device -> host. "delayed": side-stream copies
    that finish late (as on CUDA): a repopulation still in flight when the last request ends is
    settled by the engine (`KVStore.idle`), so the idle pool is empty (CUDA found 2 pages left)."""
    if copies == "delayed":
        from dhisparse.kv.hier import adaptive as adaptive_mod
        from dhisparse.kv.memory.copies import StreamCopyEngine

        monkeypatch.setattr(adaptive_mod, "copy_engine_for", lambda device, copy, side, copy_many=None:
                            StreamCopyEngine(copy, DelayedStreams(100), copy_many))
    ref = [o.token_ids for o in LLM("tiny").generate(_reqs(5), GREEDY)]
    backed: dict[bool, int] = {}
    for share in (True, False):
        if not share:
            monkeypatch.setattr(PrefixPages, "borrow", lambda self, req, item, n: 0)
        llm = checked(LLM("tiny", preset=preset, hot_cache_rows=16, page_size=16, debug_checks=True,
                          kv_pool_bytes=56 * 6 * 16 * 40 * 4, admission_reserve_pages=2))
        llm.prepare_prefix(PREFIX)
        store, runs = llm.engine.store, llm.engine.store._copy_runs
        count = [0]

        def copy_runs(pairs, runs=runs, count=count):
            count[0] += sum(1 for kind, _, _ in pairs if kind == "backup")
            runs(pairs)

        store._copy_runs = copy_runs
        assert [o.token_ids for o in llm.generate(_reqs(5), GREEDY)] == ref
        backed[share] = count[0]
        store.check_integrity()
        assert llm.engine.stats().as_dict()["kv_pages_used"] == 0
    assert backed[True] <= backed[False] - 5 * (100 // 16)  # each importer's 6 prefix pages


def test_nothing_writes_a_shared_page():
    llm = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16)
    llm.prepare_prefix(PREFIX)
    eng, store = llm.engine, llm.engine.store
    rid = eng.add_request(_reqs(1)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    page = store.host.tables[rid][0]
    with pytest.raises(RuntimeError, match="shared host pages"):
        store._copy_runs([("backup", page, 0)])


def test_borrowing_lets_more_importers_fit_a_small_host_pool():
    """A host pool of 12 pages holds one private 7-page history; borrowing the 6 prefix pages
    leaves each importer 1-2 pages of its own, so all three run at once."""
    page = LLM("tiny", preset="hisparse", page_size=16).engine.store.host.page_nbytes
    llm = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16, host_pool_bytes=12 * page)
    llm.prepare_prefix(PREFIX)
    eng = llm.engine
    for p in _reqs(3):
        eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()
    eng.step()
    assert len(eng.store.reqs) == 3 and eng.store.host.pool.available >= 0
    eng.store.check_integrity()


def test_no_room_to_share_falls_back_to_private_copies(caplog):
    """Sharing never needs more host pages than a private copy, except when the prompt is the
    stored prefix itself: the last row is recomputed (not imported), so the importer borrows one
    page fewer than the prefix shares. A pool of exactly one request's pages then cannot share."""
    prefix = PREFIX[:96]  # 6 complete pages
    page = LLM("tiny", preset="hisparse", page_size=16).engine.store.host.page_nbytes
    ref = [o.token_ids for o in LLM("tiny").generate([prefix], GREEDY)]
    llm = checked(LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16, host_pool_bytes=8 * page,
                      debug_checks=True))
    llm.prepare_prefix(prefix)
    with caplog.at_level("INFO", logger="dhisparse.kv"):
        assert [o.token_ids for o in llm.generate([prefix], GREEDY)] == ref
    assert any("not shared on host" in r.message for r in caplog.records)
    assert not llm.engine.store.host.shared
    llm.engine.store.check_integrity()


def test_a_prefix_exported_again_retires_the_old_shared_pages():
    """Exporting a stored prefix again (an export request: prepare_prefix keeps a stored prefix)
    replaces its item, whose bytes may differ: new importers borrow the new item's pages; the old
    ones are freed once nobody borrows them, so a host pool with room for one shared copy keeps
    serving."""
    page = LLM("tiny", preset="hisparse", page_size=16).engine.store.host.page_nbytes
    ref = [o.token_ids for o in LLM("tiny").generate(_reqs(3), GREEDY)]
    llm = checked(LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16, host_pool_bytes=12 * page,
                      debug_checks=True))
    eng = llm.engine
    llm.prepare_prefix(PREFIX)
    first = eng.prefixes.get(PREFIX)
    rid = eng.add_request(PREFIX, SamplingParams(max_tokens=1), export_prefix=True)  # imports (borrows) the first
    while rid in eng.requests:
        eng.step()
    assert eng.prefixes.get(PREFIX) is not first
    assert [o.token_ids for o in llm.generate(_reqs(3), GREEDY)] == ref
    host = eng.store.host
    assert len(host.shared) == 1 and not host.borrowed
    host.check_integrity()
    assert host.pool.available == host.pool.num_pages - 100 // 16


def test_preparing_a_stored_prefix_again_keeps_it_without_features():
    llm = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16)
    llm.prepare_prefix(PREFIX)
    item = llm.engine.prefixes.get(PREFIX)
    assert llm.prepare_prefix(PREFIX) == len(PREFIX) and llm.engine.prefixes.get(PREFIX) is item


def test_a_prefix_without_the_drafters_features_is_prefilled_not_imported():
    """A prefix stored by an engine without a feature-reading drafter lacks DFlash's features: a
    DFlash engine prefills such prompts in full (no import, nothing borrowed), and preparing the
    prefix there prefills it again with features; later prompts then import it. Tokens exact."""
    ref = [o.token_ids for o in LLM("tiny").generate(_reqs(2), GREEDY)]
    plain = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16)
    plain.prepare_prefix(PREFIX)
    llm = LLM("tiny", preset="adaptive+spec", hot_cache_rows=16, page_size=16, debug_checks=True)
    llm.engine.prefixes = plain.engine.prefixes  # shared, as bench/gpu_serving.py shares them
    assert not llm.engine.spec.serves(llm.engine.prefixes.get(PREFIX))
    outs = llm.generate(_reqs(2), GREEDY)
    assert [o.token_ids for o in outs] == ref and all(o.metrics.imported_len == 0 for o in outs)
    llm.prepare_prefix(PREFIX)
    assert llm.engine.spec.serves(llm.engine.prefixes.get(PREFIX))
    outs = llm.generate(_reqs(2), GREEDY)
    assert [o.token_ids for o in outs] == ref and all(o.metrics.imported_len == len(PREFIX) for o in outs)


def test_exported_rows_are_the_stores_rows_read_a_layer_at_a_time():
    """`read_rows` (a prefix's export) returns host tensors [L, n, d] / [F, n, iD] equal to the store's own rows at
    the request's locations, every layer its own (read one layer at a time, so a long prompt's export holds one
    layer's rows on the device, not the whole prompt's). The hierarchy's `read_rows` is its resident part's, read
    at the prompt's end before the hand-off (engine/prefixes.py). Breakage tried: every layer given layer 0's rows."""
    from dhisparse.core.rows import gather_rows

    eng = LLM("tiny", preset="resident", page_size=16).engine
    rid = eng.add_request(PREFIX, SamplingParams(max_tokens=8, ignore_eos=True))
    while not eng.requests[rid].output_ids:
        eng.step()  # until prefilled: PREFIX's rows are written, the request still running
    res = eng.store
    latent, index = res.read_rows(rid, len(PREFIX))
    a = res.arena
    lat, idx = res.latent_locs(rid, len(PREFIX)), res.index_locs(rid, len(PREFIX))
    assert latent.device.type == index.device.type == "cpu"
    assert tuple(latent.shape[:2]) == (a.cfg.num_layers, len(PREFIX))
    for l in range(a.cfg.num_layers):
        assert torch.equal(latent[l], gather_rows(a.latent_rows(l), lat).cpu())
    for j, l in enumerate(a.layout.index_layers):
        assert torch.equal(index[j], a.read_index(l, idx).cpu())
    assert not torch.equal(latent[0], latent[-1])  # the layers differ, so a layer mix-up shows
