"""The `hisparse` preset against `resident`: exactness (I1, I2, I7), placement of every returned
location, faults (bad positions, aborts, host pool exhaustion)."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from kv_check import checked

GREEDY = SamplingParams(max_tokens=36, ignore_eos=True)


def prompts(n: int, vocab: int = 120, base: int = 11) -> list[list[int]]:
    return [[3 + (7 * i + 5 * j + i * j) % (vocab - 3) for j in range(base + 13 * i)] for i in range(n)]


@pytest.mark.parametrize("arch", ["glm", "v32"])
def test_hisparse_matches_resident_with_b_equal_k(hf_checkpoints, arch):
    folder = str(getattr(hf_checkpoints, arch))
    ps = prompts(4)
    ref = [o.token_ids for o in LLM(folder, page_size=4).generate(ps, GREEDY)]
    llm = LLM(folder, preset="hisparse", page_size=4, debug_checks=True)
    k = llm.engine.model_config.index_topk
    llm = checked(LLM(folder, preset="hisparse", page_size=4, hot_cache_rows=k, debug_checks=True))
    assert llm.engine.store.B == k
    out = [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert out == ref
    st = llm.engine.stats().as_dict()
    assert st["host_fetched_share"] > 0.1  # B == k: most steps miss
    assert st["kv_pages_used"] == 0


def test_hisparse_prefix_import_and_chunking_match_resident():
    prefix = prompts(5)[4]
    reqs = [prefix + [50 + i] for i in range(3)]
    ref = [o.token_ids for o in LLM("tiny").generate(reqs, GREEDY)]
    llm = checked(LLM("tiny", preset="hisparse", hot_cache_rows=16, max_num_batched_tokens=9, page_size=8, debug_checks=True))
    llm.prepare_prefix(prefix)
    outs = llm.generate(reqs, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.metrics.imported_len == len(prefix) for o in outs)


def test_debug_rejects_positions_outside_the_request():
    llm = LLM("tiny", preset="hisparse", debug_checks=True)
    eng = llm.engine
    eng.add_request(prompts(1)[0], SamplingParams(max_tokens=4))
    eng.step()  # prefill + handoff
    store: HierarchicalKV = eng.store
    req = next(iter(store.reqs))
    from dhisparse.core.batch import ForwardBatch

    n = eng.requests[req].num_computed
    batch = ForwardBatch.build([([5], n)])
    ctx = store.context(batch, [req])
    bad = torch.full((1, eng.model_config.index_topk), -1)
    bad[0, 0] = n + 5
    with pytest.raises(ValueError, match="outside its request"):
        ctx.locate(0, bad)


def test_abort_mid_run_frees_everything():
    llm = LLM("tiny", preset="hisparse", debug_checks=True, page_size=8)
    eng = llm.engine
    a = eng.add_request(prompts(3)[2], SamplingParams(max_tokens=60))
    eng.add_request(prompts(2)[1], SamplingParams(max_tokens=20))
    for _ in range(6):
        eng.step()
    assert eng.store.host.pool.usage().used > 0
    eng.abort(a)
    eng.store.check_integrity()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().kv_pages_used == 0 and eng.store.host.pool.usage().used == 0
    assert sorted(eng.store.free_slots) == list(range(eng.config.max_running_requests))


def test_host_pool_exhaustion_makes_admission_wait(caplog):
    ps = prompts(4)
    ref = [o.token_ids for o in LLM("tiny").generate(ps, GREEDY)]
    page = LLM("tiny").engine.page_bytes
    llm = LLM("tiny", preset="hisparse", page_size=16, host_pool_bytes=8 * page, debug_checks=True)
    with caplog.at_level("INFO", logger="dhisparse.kv"):
        out = [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert out == ref
    assert any("host pool" in r.message for r in caplog.records)


@pytest.mark.parametrize("preset,hot,spec", [("hisparse", 16, {}), ("adaptive", 16, {}),
                                             ("hisparse", 64, {"speculative_algorithm": "ngram"})])
def test_deferred_triton_resolver_matches_reference_resolver(preset, hot, spec):
    """The Triton resolver runs sync-free (defer=True, counters folded on read): same tokens as
    resident and the same census as the reference resolver, with hot-cache misses and direct calls;
    with its copies fused into the plan kernel (resolver_copy="fused": one launch plans and copies
    the producer's rows) every located row is also checked against a dense mirror (I2). With the
    hot_entry index (resolver_lookup="index") the debug checks also hold it to hot_pos's inverse."""
    ps, short = prompts(3), SamplingParams(max_tokens=10, ignore_eos=True)
    ref = [o.token_ids for o in LLM("tiny", page_size=4).generate(ps, short)]
    census = {}
    runs = (("torch", "separate", "scan"), ("triton", "separate", "scan"), ("triton", "fused", "scan"),
            ("triton", "separate", "index"), ("torch", "separate", "index"))
    for resolver, copy, lookup in runs:
        llm = LLM("tiny", preset=preset, resolver=resolver, resolver_copy=copy, hot_cache_rows=hot, page_size=4,
                  kv_pool_bytes=1 << 20, max_running_requests=8, resolver_lookup=lookup,
                  debug_checks=copy == "fused" or lookup == "index", **spec)
        assert llm.engine.store.deferred == (resolver == "triton")
        assert llm.engine.store.fuse_copies == (copy == "fused")
        assert (llm.engine.store.hot_entry is not None) == (lookup == "index")
        if copy == "fused":
            llm = checked(llm)
        assert [o.token_ids for o in llm.generate(ps, short)] == ref
        targets, groups = len(llm.engine.store.copy_targets), len(llm.engine.store.groups)
        assert targets == 0 if resolver == "torch" else (targets == groups or preset == "adaptive")  # one a group
        c = llm.engine.store.census
        census[resolver, copy, lookup] = {k: getattr(c, k) for k in c.FIELDS} | {"calls": c.calls}
    assert all(census[r] == census["torch", "separate", "scan"] for r in runs)
    assert census["torch", "separate", "scan"]["host"] > 0 or preset == "adaptive"


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_deferred_staging_matches_reference_staging(preset):
    """Verification unions beyond a 16-row hot cache: the Triton resolver stages the overflow with
    device ops (no sync) -- the same tokens as the reference's host staging, both with overflow.
    (Census totals are not compared: the number of verification rounds may differ between runs.)"""
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = [[3 + (7 * i + 5 * j) % 120 for j in range(20 + 23 * i)] for i in range(3)]
    ref = {tuple(p): o.token_ids for p, o in zip(ps, LLM("tiny").generate(ps, sp))}
    census = {}
    for resolver, lookup in (("torch", "scan"), ("triton", "scan"), ("triton", "index")):
        llm = LLM.__new__(LLM)
        llm.engine = Engine(EngineConfig(preset=preset, resolver=resolver, hot_cache_rows=16, page_size=4,
                                         kv_pool_bytes=1 << 20, max_running_requests=8, speculative_algorithm="oracle",
                                         speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=3.0,
                                         resolver_lookup=lookup, debug_checks=lookup == "index"),
                            oracle_reference=ref)
        assert [o.token_ids for o in llm.generate(ps, sp)] == [ref[tuple(p)] for p in ps]
        assert llm.engine.store.deferred == (resolver == "triton")
        census[resolver, lookup] = llm.engine.store.census
    if preset == "hisparse":  # adaptive keeps these short histories resident: every row is direct
        assert all(c.overflow > 0 for c in census.values())


def test_staging_rows_are_a_view_of_their_pool_pages():
    """The verification staging arena lives in the pages the pool holds for it (one allocation,
    counted once): its rows are a view of those pages' storage, so a staged row lands in the
    arena's bytes. (Breakage tried: a separate `torch.zeros` staging tensor, as before: fails.)"""
    from dhisparse.kv.memory.arena import KVArena
    from dhisparse.kv.memory.host import HostStore
    from dhisparse.models.tiny import tiny_config

    cfg = tiny_config()
    arena = KVArena(cfg, 64, 4, "cpu", torch.float32)
    host = HostStore(16, cfg.num_layers, 4, arena.row_width, arena.dtype, pin=False)
    kv = HierarchicalKV(arena, host, 16, 3, max_queries=4)
    pages = arena.pool.owned_by("staging")
    assert pages == list(range(len(pages))) and kv.stage.shape == (1, 3 * 4 * cfg.index_topk, arena.row_width)
    assert kv.stage.untyped_storage().data_ptr() == arena.storage.untyped_storage().data_ptr()
    kv.stage[0, 5] = 7.0
    assert torch.equal(arena.storage[pages[0]].view(-1)[5 * arena.row_width : 6 * arena.row_width],
                       torch.full((arena.row_width,), 7.0))
    kv.check_integrity()


def test_kept_resolver_state_follows_a_grown_host_table():
    """A store keeps one ResolverState a group (`kv/hier/tables.resolver_state`); the host table it
    names is reallocated when a history outgrows it (`SlotTable.sync`), so every call must hand the
    resolver the current one, never the table the state was first built with. (Breakage tried: the
    per-call refresh dropped: fails here; engine runs size the table from max_len and never grow it.)"""
    from dhisparse.kv.memory.arena import KVArena
    from dhisparse.kv.memory.host import HostStore
    from dhisparse.models.tiny import tiny_config

    cfg = tiny_config()
    arena = KVArena(cfg, 64, 4, "cpu", torch.float32)
    kv = HierarchicalKV(arena, HostStore(16, cfg.num_layers, 4, arena.row_width, arena.dtype, pin=False), 16, 3)
    first = kv.resolver_state(0)
    assert first.host_table is kv.host_table and kv.resolver_state(0) is first  # built once, kept
    kv.host_pages.sync([(1, list(range(9)))])  # wider than the table: reallocated
    st = kv.resolver_state(0)
    assert st is first and st.host_table is kv.host_table and st.host_table.shape[1] >= 9
    assert st.host_table[1, :9].tolist() == list(range(9))
