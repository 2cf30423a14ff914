"""DeepSeek-V4's row hierarchy runs the GLM path's resolver step (issue 23 item 4):
`V4HierPass.locate` calls `locate_group` / `copy_group` (kv/hier/resolver_step.py), so with the Triton
resolver (interpreted on CPU) V4 gets the deferred, sync-free plan, its device-side staging and
vectorised per-request gathers; tokens equal `resident` (I7) and every located row is checked
against a shadow copy (I2, `SourceCheck`). V4's stores take the GLM stores' stream settings
(`side_loads`, `side_stream`) and the V4 wrapper forwards `loading`.

The model is `tiny_v41` (two shared CSA sources; selecting layers 1, 2, 5, 7; reuse layers 3, 6,
8; layer 3 reuses source 1 after source 2's call: the staging replay path). Shapes are tiny:
interpreted Triton is slow.
"""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.kernels.resolver_ref import ResolvePlan
from dhisparse.kv.hier import adaptive as adaptive_mod, hierarchy as hierarchy_mod, resolver_step
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.copies import StreamCopyEngine, SyncCopyEngine
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.memory.loads import StreamLoads, SyncLoads
from dhisparse.kv.resident import store as resident_mod
from dhisparse.kv.v4.hier import V4AdaptiveKV, V4HierarchicalKV, V4HierStore, v4_row_geometry
from dhisparse.kv.v4.hier_pass import V4HierPass
from v4_engine_util import SourceCheck, engine, generate, loaded_v41, tiny_v41
from v4_fixtures import one_thread as _one_thread, prompt_ids

try:
    from dhisparse.kernels.resolver import TritonResolvePlan
except ImportError:  # no Triton: the deferred-path tests are skipped, the stream tests still run
    TritonResolvePlan = None
needs_triton = pytest.mark.skipif(TritonResolvePlan is None, reason="the Triton resolver is not installed")

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [prompt_ids(n, seed=n) for n in (11, 26)]
SPEC = dict(speculative_algorithm="oracle", speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=2.5)
SELECTING = 4  # tiny_v41's selecting layers (1, 2, 5, 7: a "full" or "reindex" selection on a tiered source)


@pytest.fixture(scope="module")
def loaded():
    return loaded_v41()


@pytest.fixture(scope="module")
def reference(loaded) -> dict:
    return {tuple(p): o for p, o in zip(PROMPTS, generate(engine(loaded), PROMPTS, GREEDY))}


def _expected(reference) -> list[list[int]]:
    return [reference[tuple(p)] for p in PROMPTS]


class PlanLog:
    """Wraps the store's plan function: every call as (pass number, defer, slots is the pass's
    persistent `rows_ctx.slots_t`); passes numbered by V4HierPass construction, with whether any
    request of the pass decodes."""

    def __init__(self, eng, mp) -> None:
        self.calls: list[tuple[int, bool, bool]] = []
        self.passes: list[bool] = []  # pass -> has decoding requests
        self.current: V4HierPass | None = None
        kv, log = eng.store.kv, self
        plan = kv.plan_fn

        def counted(sel, slots, st, now, **kw):
            log.calls.append((len(log.passes) - 1, kw.get("defer", False), slots is log.current.rc.slots_t))
            return plan(sel, slots, st, now, **kw)

        mp.setattr(kv, "plan_fn", counted)
        init = V4HierPass.__init__

        def opened(p, *a, **k):
            init(p, *a, **k)
            log.current = p
            log.passes.append(bool(p.rc.decode_rows))

        mp.setattr(V4HierPass, "__init__", opened)

    def per_pass(self) -> list[int]:
        n = [0] * len(self.passes)
        for p, _, _ in self.calls:
            n[p] += 1
        return n


def _no_host_sync(mp) -> None:
    """The deferred path never reads a plan on the host: no materialize, no call-level direct check."""
    mp.setattr(TritonResolvePlan, "materialize", lambda self: pytest.fail("a deferred plan was materialized"))
    mp.setattr(resolver_step, "direct_plan", lambda *a: pytest.fail("host-side direct check on the deferred path"))


@needs_triton
@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_v4_deferred_triton_resolver_matches_resident(loaded, reference, preset, monkeypatch):
    """hisparse / adaptive with the Triton resolver: the deferred plan (defer=True, no host sync)
    on the pass's persistent slots tensor, tokens equal resident, every location exact.

    Resolver plan calls per pass, measured on the code before the shared step (HEAD fe2e3f5, same
    prompts, resolver="triton"): hisparse 4 in a pass with decoding requests (one per selecting
    layer, reuse layers none), or 0 where the host-side call-level direct check (`direct_plan`,
    one sync each) resolved all 4 calls; every call synchronised (eager plan + materialize +
    copies) and built its slots with `torch.tensor(rc.slots)`. adaptive 0 (these short
    histories stay published: 4 syncing direct checks a pass instead). After: hisparse 4 in
    every pass with decoding requests (the kernel takes the direct path per request, without a
    sync), adaptive 0 with no check at all (the host knows the pass is all-direct: `covers`)."""
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, preset=preset, hot_cache_rows=4, resolver="triton")
    assert eng.store.kv.deferred
    log = PlanLog(eng, monkeypatch)
    _no_host_sync(monkeypatch)
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    per_pass, decoding = log.per_pass(), log.passes
    assert any(decoding) and ck.decode_passes == sum(decoding)
    assert all(defer and persistent for _, defer, persistent in log.calls)  # never torch.tensor(rc.slots)
    census = eng.store.census
    assert census.calls == SELECTING * sum(decoding)  # one call per selecting layer, reuse layers none
    if preset == "hisparse":
        assert per_pass == [SELECTING if d else 0 for d in decoding]
        assert census.host > 0 and sum(ck.host_rows.values()) > 0  # misses were copied from host
    else:  # every decoding pass all-direct: no resolver launch, census counted on the device
        assert per_pass == [0] * len(decoding)
        assert census.direct_calls == census.calls and census.host == census.hot == 0
    assert ck.reused == 3 * len(decoding)
    # the same counters as the reference resolver (its call-level direct exits counted as calls)
    monkeypatch.undo()
    torch_census = _census(_generate_with(loaded, preset, "torch"))
    assert _census(eng) == torch_census


def _generate_with(loaded, preset: str, resolver: str):
    eng = engine(loaded, preset=preset, hot_cache_rows=4, resolver=resolver)
    generate(eng, PROMPTS, GREEDY)
    return eng


def _census(eng) -> dict:
    c = eng.store.census
    return {k: getattr(c, k) for k in c.FIELDS} | {"calls": c.calls}


@needs_triton
def test_v4_deferred_speculation_stages_and_replays_exactly(loaded, reference, monkeypatch):
    """Verification unions beyond the hot cache go through the device-side staging
    (`stage_overflow_deferred`); a reuse layer after another source's call re-launches its
    source's staged copy (`restage`, no sync: its bytes are a device tensor, counted after the
    step). Tokens and locations are exact; the census's bytes are the calls' plus the replays'."""
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, reference, preset="hisparse", hot_cache_rows=4, resolver="triton", **SPEC)
    census, store = eng.store.census, eng.store
    log = PlanLog(eng, monkeypatch)
    call_bytes, replayed = [], []
    add, count = census.add_device, V4HierStore.count_restaged
    monkeypatch.setattr(census, "add_device", lambda c, n: (call_bytes.append(n), add(c, n))[1])
    monkeypatch.setattr(V4HierStore, "count_restaged", lambda s, n: (replayed.append(n), count(s, n))[1])
    _no_host_sync(monkeypatch)
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    assert all(defer and persistent for _, defer, persistent in log.calls)
    assert log.per_pass() == [SELECTING if d else 0 for d in log.passes]
    st = eng.stats().as_dict()
    assert st["resolver_overflow"] > 0 and st["spec_rounds"] > 0 and ck.window_cuts > 0
    assert store.counters.stage_replays == len(replayed) > 0 and all(torch.is_tensor(b) for b in replayed)
    assert store._restaged is None  # folded into the census after the step
    assert census.bytes_moved == sum(int(b) for b in call_bytes) + sum(int(b) for b in replayed)
    assert sum(int(b) for b in replayed) > 0


@needs_triton
def test_plan_classes_declare_deferred():
    """`copy_group` reads `plan.deferred`: False on reference plans, True on a Triton plan until
    its counters are read."""
    e = torch.zeros(0, dtype=torch.int64)
    assert ResolvePlan(e, e, e, None).deferred is False
    assert TritonResolvePlan(e, None, None, None).deferred is True


# -- stream settings -----------------------------------------------------------------------------------
class LateStreams:
    """Fake side stream (tests/test_loads.py): a copy runs at issue, its event fires `delay`
    queries later (or when the compute stream waits for it)."""

    def __init__(self, delay: int) -> None:
        self.delay = delay

    def fence(self) -> None:
        return None

    def on_side(self, after, fn) -> list:
        fn()
        return [self.delay, False]

    def finished(self, ev: list) -> bool:
        ev[0] -= 1
        return ev[0] < 0 or ev[1]

    def wait(self, ev: list) -> None:
        ev[1] = True


def _side_kinds_on_cpu(mp, seen: dict) -> None:
    """On CPU the loads / copy engines are always in order; record the `side` setting each
    factory gets and build the side-stream kinds over a late fake stream when it is on."""
    def loads(device, side=True):
        seen.setdefault("side_loads", []).append(side)
        return StreamLoads(streams=LateStreams(3)) if side else SyncLoads()

    def copies(device, copy, side_stream=True, copy_many=None):
        seen.setdefault("side_stream", []).append(side_stream)
        return StreamCopyEngine(copy, LateStreams(2), copy_many) if side_stream else SyncCopyEngine(copy)

    mp.setattr(hierarchy_mod, "make_loads", loads)
    mp.setattr(resident_mod, "make_loads", loads)
    mp.setattr(adaptive_mod, "copy_engine_for", copies)


@pytest.mark.parametrize("side_loads, side_stream", [(True, False), (False, True)])
def test_v4_stores_take_the_glm_stream_settings(side_loads, side_stream, monkeypatch):
    """V4HierarchicalKV / V4AdaptiveKV built directly with the GLM stores' keywords: the settings
    reach the inner hierarchy (its hand-off and import loads, adaptive's copy engine), and the
    V4 wrapper answers `loading` from the row hierarchy."""
    seen: dict = {}
    _side_kinds_on_cpu(monkeypatch, seen)
    cfg = tiny_v41()
    geometry = v4_row_geometry(cfg)
    loads_kind = StreamLoads if side_loads else SyncLoads
    for cls, kw in ((V4HierarchicalKV, {}), (V4AdaptiveKV, dict(side_stream=side_stream))):
        arena = KVArena(geometry, 64, 4, "cpu", torch.float32)
        host = HostStore(64, geometry.num_layers, 4, cfg.head_dim, torch.float32, pin=False)
        kv = cls(arena, host, 4, 2, v4=cfg, max_len=64, side_loads=side_loads, **kw)
        assert isinstance(kv.handoffs, loads_kind) and isinstance(kv.resident.loads, loads_kind)
        if cls is V4AdaptiveKV:
            assert isinstance(kv.copies, StreamCopyEngine if side_stream else SyncCopyEngine)
            assert kv.res.copies is kv.copies
        store = V4HierStore(cfg, kv, torch.device("cpu"), torch.float32)
        assert store.admit("a", 40, 30)
        assert not store.loading("a")
        if side_loads:  # a pending hand-off holds the request through the wrapper
            kv.handoffs.run("a", lambda: None)
            assert store.loading("a") and kv.loading("a")
            kv.handoffs.settle("a")
        assert not store.loading("a")
        store.free("a")
    assert seen["side_loads"] == [side_loads] * 4 and seen["side_stream"] == [side_stream]


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_v4_engine_with_side_loads_matches_resident(loaded, reference, preset, monkeypatch):
    """EngineConfig(load_stream="side", copy_stream="compute") reaches V4's row hierarchy; with a
    late side stream standing in for CUDA's, hisparse hand-offs hold their requests (the
    scheduler never runs a `loading` request) and tokens stay exact."""
    seen: dict = {}
    _side_kinds_on_cpu(monkeypatch, seen)
    eng = engine(loaded, preset=preset, hot_cache_rows=4, load_stream="side", copy_stream="compute")
    kv = eng.store.kv
    assert isinstance(kv.handoffs, StreamLoads) and isinstance(kv.resident.loads, StreamLoads)
    assert set(seen["side_loads"]) == {True}
    if preset == "adaptive":
        assert seen["side_stream"] == [False] and isinstance(kv.copies, SyncCopyEngine)
    held: list = []
    schedule = eng.scheduler.schedule

    def checked_schedule():
        chunks = schedule()
        held.extend(r.request_id for r in eng.scheduler.running if eng.store.loading(r.request_id))
        assert not any(eng.store.loading(c.req.request_id) for c in chunks), "a loading request was scheduled"
        return chunks

    monkeypatch.setattr(eng.scheduler, "schedule", checked_schedule)
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    if preset == "hisparse":  # adaptive keeps a finished prompt's pages on the device: no hand-off copy
        assert held
    assert eng.stats().as_dict()["kv_pages_used"] == 0  # hand-off pages freed once their copy was done


def test_v4_adaptive_side_copy_stream_under_a_tight_pool(loaded, monkeypatch):
    """copy_stream="side": V4 adaptive's residency copies (backups, repopulation) complete late on
    a fake side stream while a tight pool (62 pages of 4 rows) forces reclaims; tokens stay exact."""
    prompts = [prompt_ids(n, seed=n) for n in (11, 26, 41, 9, 22, 37)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = generate(engine(loaded), prompts, params)
    seen: dict = {}
    _side_kinds_on_cpu(monkeypatch, seen)
    eng = engine(loaded, preset="adaptive", hot_cache_rows=4, copy_stream="side", kv_pool_bytes=62 * 1024,
                 max_running_requests=4, admission_lookahead=0,  # strict FCFS: admissions must reclaim
                 admission_reserve_pages=0)  # no reserve: the tight pool itself forces the reclaims
    assert seen["side_stream"] == [True] and isinstance(eng.store.kv.copies, StreamCopyEngine)
    assert generate(eng, prompts, params) == want
    assert eng.stats().as_dict()["reclaimed_pages"] > 0
