"""DeepSeek-V4 prefix export / import (kv/v4/prefix.py): a prepared prefix is the exporter's whole
streaming state (sliding windows, compressor raw tails, every compressed row); requests whose
prompt starts with it import it on admission and prefill only their suffix, token-identical to a
reference engine that prefills everything, under `resident`, `hisparse`, `adaptive` (+ n-gram
speculation) and FP8 rows. A prefix of 22 tokens ends inside a window (5 CSA rows: one complete
row page of 4, 2 HCA rows + 6 raw tokens); one of 32 ends on a window boundary of both
compressors (8 CSA rows: 2 pages). Hierarchical presets: every located row is checked against a
shadow copy of the exporter's emitted rows (I2, `SourceCheck`); after every step every row
below a decoding request's tail has a host copy equal to that shadow or is published optional
history (I1), and importers borrow the prefix's shared host pages. Mutations of the import (raw
tails or sliding windows zeroed or cut, CSA rows not put into the hierarchy) make the checks fail."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import pytest
import torch
from disagg_hooks import host_copies_equal_shadow

from dhisparse import SamplingParams
from dhisparse.core.kvformat import RowFormat
from dhisparse.kv.v4 import hier as v4_hier
from dhisparse.kv.v4 import store as v4_store
from dhisparse.kv.v4.hier import V4HierStore
from dhisparse.kv.v4.prefix import V4Prefix
from v4_engine_util import SourceCheck, engine, loaded_v41
from v4_fixtures import one_thread as _one_thread, prompt_ids

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PREFIXES = [prompt_ids(22, seed=1), prompt_ids(32, seed=2)]
SUFFIXES = [prompt_ids(1, seed=11), [5, 6, 7, 8, 9] * 3, prompt_ids(11, seed=13)]
PROMPTS = [p + s for p in PREFIXES for s in SUFFIXES] + PREFIXES  # the last two ARE the prefixes
SMALL = dict(hot_cache_rows=4, kv_pool_bytes=1 << 20, host_pool_bytes=1 << 20)  # cheap debug checks

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def loaded():
    return loaded_v41()


@pytest.fixture(scope="module")
def reference(loaded):
    """kv_cache_dtype -> outputs of PROMPTS on `resident`, no prefix (exactness is per row format)."""
    cache = {}

    def get(dtype: str = "auto") -> list[list[int]]:
        if dtype not in cache:
            cache[dtype] = [o.token_ids for o in run(engine(loaded, kv_cache_dtype=dtype, **SMALL), PROMPTS)]
        return cache[dtype]

    return get


def run(eng, prompts, check=None) -> list:
    """Outputs of prompts (finished RequestOutputs, in order); check(eng) after every step."""
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if check is not None:
            check(eng)
    return [done[i] for i in ids]


def shadow_imports(ck: SourceCheck, monkeypatch) -> dict:
    """Importers' shadow rows = the exporter's emitted rows; returns req -> borrowed host pages."""
    exporter, borrowed = {}, {}
    orig_export, orig_import = V4HierStore.export_prefix, V4HierStore.import_prefix

    def export_prefix(store, req, token_ids, features, pin):
        exporter[tuple(token_ids)] = req
        return orig_export(store, req, token_ids, features, pin)

    def import_prefix(store, req, item, n):
        src = exporter[item.token_ids]
        for (rid, layer, w), row in list(ck.rows.items()):
            if rid == src and w < n // store.m:
                ck.rows[(req, layer, w)] = row
        orig_import(store, req, item, n)
        borrowed[req] = store.kv.host.borrowed_pages(req)

    monkeypatch.setattr(V4HierStore, "export_prefix", export_prefix)
    monkeypatch.setattr(V4HierStore, "import_prefix", import_prefix)
    return borrowed


def host_copies(ck: SourceCheck):
    """I1 after a step: each row below a decoding request's tail is published optional history or
    has a host copy holding exactly the row the request emitted or imported."""

    def check(eng) -> None:
        kv, sources = eng.store.kv, eng.model_config.csa_sources
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # backups are asynchronous copies into pinned memory
        host_copies_equal_shadow(kv, sources, ck.rows)

    return check


class Prefixed(NamedTuple):
    """A run of PROMPTS after preparing PREFIXES: outputs in order, the engine, req -> borrowed
    host pages, pages the idle engine held (the staging arena under speculation), the checker."""

    outs: list
    eng: object
    borrowed: dict
    idle: int
    ck: SourceCheck | None


def prefixed_outputs(loaded, preset: str, monkeypatch, reference=None, after=None, **kw) -> Prefixed:
    """after(eng): run after every step, after the I1 check."""
    eng = engine(loaded, reference, preset=preset, **SMALL, **kw)
    idle = eng.stats().as_dict()["kv_pages_used"]
    ck, checks, borrowed = None, [after] if after else [], {}
    if preset != "resident":
        ck = SourceCheck().install(monkeypatch)
        borrowed, checks = shadow_imports(ck, monkeypatch), [host_copies(ck), *checks]
    assert [eng.prepare_prefix(p) for p in PREFIXES] == [len(p) for p in PREFIXES]
    return Prefixed(run(eng, PROMPTS, lambda e: [c(e) for c in checks]), eng, borrowed, idle, ck)


ORACLE = dict(speculative_algorithm="oracle", speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=2.5)
CASES = [("resident", {}), ("hisparse", {}), ("adaptive", {}), ("adaptive", {"speculative_algorithm": "ngram"}),
         ("adaptive", ORACLE), ("resident", {"kv_cache_dtype": "fp8_e4m3"}),
         ("hisparse", {"kv_cache_dtype": "fp8_e4m3"})]


@pytest.mark.parametrize("preset,kw", CASES, ids=lambda x: x if isinstance(x, str) else
                         str(x.get("kv_cache_dtype", x.get("speculative_algorithm", "-"))))
def test_v4_prefix_import_is_exact(loaded, reference, preset, kw, monkeypatch):
    want_tokens = reference(kw.get("kv_cache_dtype", "auto"))
    oracle = {tuple(p): o for p, o in zip(PROMPTS, want_tokens)} if kw is ORACLE else None
    r = prefixed_outputs(loaded, preset, monkeypatch, oracle, **kw)
    assert [o.token_ids for o in r.outs] == want_tokens
    want = [len(p) for p in PREFIXES for _ in SUFFIXES] + [0, 0]  # a prompt equal to its prefix imports nothing
    assert [o.metrics.imported_len for o in r.outs] == want
    st = r.eng.stats().as_dict()
    assert st["kv_pages_used"] == r.idle and len(r.eng.prefixes) == 2
    if preset != "resident":  # complete row pages of the prefix are borrowed shared host pages
        m, ps = r.eng.model_config.csa_rate, r.eng.store.kv.page_size
        assert sorted(r.borrowed.values()) == sorted(len(p) // m // ps for p in PREFIXES for _ in SUFFIXES)
        assert st["resolver_calls"] > 0 and r.ck.located > 0
    if preset == "hisparse":
        assert st["host_selected_rows"] > 0  # history, imported rows included, fetched from host
    if "speculative_algorithm" in kw:
        assert st["spec_rounds"] > 0 and st["spec_draft_calls"] > 0
    if kw is ORACLE:  # rejections inside compression windows of importing requests, rolled back exactly
        assert st["spec_tokens_per_round"] > 1.5 and r.ck.window_cuts > 0


def test_v4_prefix_prepared_over_a_prefix(loaded, monkeypatch):
    """A prefix whose own prefill imported a shorter one exports the same state as a full prefill."""
    long = PREFIXES[0] + SUFFIXES[2]
    prompts = [long + SUFFIXES[0], PREFIXES[0] + SUFFIXES[1]]
    want = [o.token_ids for o in run(engine(loaded, **SMALL), prompts)]
    eng = engine(loaded, preset="hisparse", **SMALL)
    ck = SourceCheck().install(monkeypatch)
    borrowed, check = shadow_imports(ck, monkeypatch), host_copies(ck)
    eng.prepare_prefix(PREFIXES[0])
    eng.prepare_prefix(long)  # its export request imports PREFIXES[0]
    outs = run(eng, prompts, check)
    assert [o.token_ids for o in outs] == want and [o.metrics.imported_len for o in outs] == [len(long), 22]
    assert len(borrowed) == 3


def reclaim_all(eng) -> None:
    """Reclaim every ready optional page (eq. 4 over all of them), as an admission under pressure would."""
    res, pool = eng.store.kv.res, eng.store.kv.pool
    ready = res.coverage()[0]
    if ready:
        assert res.reclaim(ready + res.retiring() + pool.available - res.reserve)


def test_v4_prefix_reclaimed_imports_are_read_from_host(loaded, reference, monkeypatch):
    """`adaptive` with every optional page reclaimed after each step: imported rows (borrowed
    pages: retired with no copy) are read from the prefix's shared host pages, or repopulated."""
    r = prefixed_outputs(loaded, "adaptive", monkeypatch, after=reclaim_all)
    assert [o.token_ids for o in r.outs] == reference()
    st = r.eng.stats().as_dict()
    assert st["reclaimed_pages"] > 0 and st["host_selected_rows"] > 0 and max(r.borrowed.values()) == 2


def test_v4_prefix_moves_stored_bytes(loaded, monkeypatch):
    """FP8 rows are exported and imported as stored bytes: no row is encoded or decoded by an import."""
    eng = engine(loaded, preset="hisparse", kv_cache_dtype="fp8_e4m3", **SMALL)
    eng.prepare_prefix(PREFIXES[0])
    item = eng.prefixes.get(PREFIXES[0])
    assert isinstance(item, V4Prefix) and item.tiered.latent.dtype == eng.store.kv.arena.formats.latent.storage_dtype
    assert not item.tiered.latent.dtype.is_floating_point and item.rows  # HCA rows kept as bytes too
    calls, inside = [], []
    for name in ("encode", "decode"):
        orig = getattr(RowFormat, name)
        monkeypatch.setattr(RowFormat, name, lambda f, x, _o=orig, _n=name: (inside and calls.append(_n), _o(f, x))[1])
    orig_import = V4HierStore.import_prefix

    def import_prefix(store, req, it, n):
        inside.append(1)
        orig_import(store, req, it, n)
        inside.clear()

    monkeypatch.setattr(V4HierStore, "import_prefix", import_prefix)
    assert run(eng, [PREFIXES[0] + SUFFIXES[0]])[0].metrics.imported_len == len(PREFIXES[0])
    assert calls == []
    short = prompt_ids(3, seed=3)  # no compressed row yet: nothing for the row hierarchy
    eng.prepare_prefix(short)
    assert run(eng, [short + SUFFIXES[0]])[0].metrics.imported_len == 3 and calls == []
    assert eng.store.import_len(item, len(PREFIXES[0]) - 1) == 0 and eng.store.import_len(item, 22) == 22


def _zero_raws(t):
    return replace(t, kv_raw=None if t.kv_raw is None else torch.zeros_like(t.kv_raw),
                   idx_raw=None if t.idx_raw is None else torch.zeros_like(t.idx_raw))


MUTATIONS = {
    "raw tails zeroed": _zero_raws,
    "sliding windows zeroed": lambda t: replace(t, window=torch.zeros_like(t.window)),
    "sliding windows cut": lambda t: replace(t, window_start=t.window_start + 1, window=t.window[1:]),
    "raw tails cut": lambda t: replace(t, raw_start=t.raw_start + 1, kv_raw=None if t.kv_raw is None else t.kv_raw[1:],
                                       idx_raw=None if t.idx_raw is None else t.idx_raw[1:]),
}


MUTATION_CASES = [("resident", "raw tails zeroed", "tokens"), ("resident", "sliding windows zeroed", "tokens"),
                  ("resident", "raw tails cut", "refused"), ("hisparse", "raw tails zeroed", "tokens"),
                  ("hisparse", "sliding windows zeroed", "tokens"), ("hisparse", "sliding windows cut", "refused"),
                  ("hisparse", "CSA rows not imported", "I2")]


@pytest.mark.parametrize("preset,name,caught", MUTATION_CASES)
def test_v4_prefix_checks_can_fail(loaded, reference, preset, name, caught, monkeypatch):
    """An import that loses part of the state is caught: wrong tokens, a refused import (the
    state's `adopt` raises StateError: the request fails) or the I2 row check."""
    if name in MUTATIONS:
        module = v4_store if preset == "resident" else v4_hier
        orig = module.adopt_tails
        monkeypatch.setattr(module, "adopt_tails", lambda st, item, dev: orig(
            st, replace(item, layers=tuple(MUTATIONS[name](t) for t in item.layers)), dev))
    else:
        monkeypatch.setattr(v4_hier.HierarchicalKV, "import_prefix", lambda kv, req, item, n: None)
    if caught == "I2":
        with pytest.raises(AssertionError):
            prefixed_outputs(loaded, preset, monkeypatch)
        return
    outs = prefixed_outputs(loaded, preset, monkeypatch).outs
    reasons = [o.finish_reason for o in outs]
    if caught == "refused":
        assert reasons.count("error") == len(PREFIXES) * len(SUFFIXES) and "StateError" in outs[0].error
    else:
        assert "error" not in reasons and [o.token_ids for o in outs] != reference()
