"""The fused Triton resolver against the PyTorch reference, bit for bit (TRITON_INTERPRET on CPU).

Outputs (locations, copy plan, counters) and state mutations (hot_pos, hot_stamp) must be equal.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from test_resolver_reference import (  # noqa: E402
    W, assert_rows_right, clone_state, dev_rows_for, host_rows_for, make_state, sel_of)

from dhisparse.kernels.resolver import PlanWorkspace, launch_copies, plan_triton, run_copies_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import hot_entry_of, plan_reference, run_copies, with_hot_entry  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _boom(*args):
    """Stands in for a full-path phase in test_all_direct_skips_dedup_and_scan."""
    tl.static_assert(False, "full resolver path taken")


class Pair:
    """A reference state (CPU) and a kernel state (DEV) stepped together and compared exactly.
    hot_map: both keep the `hot_entry` index (the kernel then looks hits up instead of scanning)."""

    def __init__(self, st, hot_map=False):
        if hot_map:
            st = with_hot_entry(st)
        self.ref, self.dev = clone_state(st), clone_state(st, DEV)

    def step(self, sel, slots, now, defer=False, ws=None, distinct=False, miss_order="host"):
        slots = torch.as_tensor(slots)
        want = plan_reference(sel, slots, self.ref, now, miss_order=miss_order)
        got = plan_triton(sel.to(DEV), slots.to(DEV), self.dev, now, defer=defer, workspace=ws, distinct=distinct,
                          miss_order=miss_order)
        if defer:
            assert got.counters is None
            got.materialize()
        assert torch.equal(got.loc.cpu(), want.loc), (got.loc, want.loc)
        assert torch.equal(got.copy_src.cpu(), want.copy_src), (got.copy_src, want.copy_src)
        assert torch.equal(got.copy_dst.cpu(), want.copy_dst), (got.copy_dst, want.copy_dst)
        assert got.counters == want.counters
        assert torch.equal(self.dev.hot_pos.cpu(), self.ref.hot_pos)
        assert torch.equal(self.dev.hot_stamp.cpu(), self.ref.hot_stamp)
        if self.ref.hot_entry is not None:  # both kept it in step with hot_pos
            assert torch.equal(self.ref.hot_entry, hot_entry_of(self.ref.hot_pos, self.ref.hot_entry.shape[1]))
            assert torch.equal(self.dev.hot_entry.cpu(), self.ref.hot_entry)
        return want, got


def fill_hot(st, s, positions, stamps):
    st.hot_pos[s, : len(positions)] = torch.tensor(positions)
    st.hot_stamp[s, : len(stamps)] = torch.tensor(stamps)


def test_all_hits():
    st = make_state(B=8)
    fill_hot(st, 1, [5, 9, 2, 30, 11], [0, 4, 2, 2, 1])
    want, _ = Pair(st).step(sel_of([9, 2, 5, 30], [30, 5, -1, -1]), [1], now=7)
    assert want.counters.hot == 4 and want.counters.host == 0


def test_all_misses_and_b_equals_k():
    st = make_state(S=3, B=5)
    p = Pair(st)
    want, _ = p.step(torch.tensor([[[3, 1, 4, 15, 9]], [[2, 6, 5, 35, 8]]]), [2, 0], now=1)
    assert want.counters.host == 10
    p.step(torch.tensor([[[10, 11, 12, 13, 14]], [[20, 21, 22, 23, 24]]]), [2, 0], now=2)  # evicts all


@pytest.mark.parametrize("stamps, misses", [
    ("one_group", 5),   # five slots share the oldest stamp: the first group covers the misses
    ("walk", 5),        # distinct stamps: the walk up the oldest few finds the threshold
    ("bisect", 12),     # twelve distinct stamps needed: past the walk's 4 steps, bisection ends it
    ("bisect_tie", 6),  # the sixth oldest is one of two slots of the stamp one past where the walk stopped
    ("spread", 12),     # stamps scaled like the engine's (now * KS^2 + rank): wide gaps, ties broken by slot
])
def test_victims_are_the_lru_oldest_in_every_threshold_path(stamps, misses):
    """Victim choice (resolver_evict._victims) on its three paths, exactly as the reference: the misses
    evict the `misses` LRU-oldest unprotected slots (stamp, then slot id), paired in slot order."""
    B = 24
    g = torch.Generator().manual_seed(len(stamps) + misses)
    perm = torch.randperm(B, generator=g)
    base = {"one_group": torch.tensor([3] * 6 + list(range(4, 22))), "walk": torch.arange(B) * 2,
            "bisect": torch.arange(B) + 7, "bisect_tie": torch.tensor([0, 1, 2, 3, 4, 5, 5] + list(range(6, 23))),
            "spread": (torch.arange(B) // 2) * (1 << 30) + torch.arange(B) % 2}[stamps]
    st = make_state(S=2, B=B, L=64, TT=4)
    fill_hot(st, 1, (40 + perm[:20]).tolist(), base[perm].tolist()[:20])
    st.hot_stamp[1, 20:] = base[perm][20:]  # slots 20.. hold no position (free) but carry stamps
    newest = base[perm][:20].argsort(descending=True)[:3]  # three hits on the newest rows: the oldest stay candidates
    hits = [40 + int(perm[i]) for i in newest]
    sel = sel_of(hits + [int(x) for x in torch.randperm(30, generator=g)[:misses]])
    want, _ = Pair(st).step(sel, [1], now=int(base.max()) + 1)
    assert want.counters.host == misses
    assert want.copy_dst.tolist() == sorted(want.copy_dst.tolist())  # slot order


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=hs.integers(8, 64), span=hs.sampled_from([3, 9, 60, 1000, 1 << 40]), misses=hs.integers(1, 64),
       seed=hs.integers(0, 2**31 - 1))
def test_victim_threshold_search_over_stamp_spans(B, span, misses, seed):
    """A full hot cache with random stamps over narrow to very wide spans (ties and gaps) and any number
    of misses: the threshold search past the walk (`resolver_evict._victims`' bisection) lands on the
    reference's LRU-oldest victims exactly. Breakages caught (session 52, on the five-way search then in
    its place): the upper end kept one short, a pivot's count read at the wrong bits, a part's upper end
    taken as the pivot below it; on the bisection: the upper end set one below mid, the lower end two past
    it."""
    g = torch.Generator().manual_seed(seed)
    st = make_state(S=1, B=B, L=400, TT=4)
    fill_hot(st, 0, (200 + torch.randperm(190, generator=g)[:B]).tolist(),
             torch.randint(0, span, (B,), generator=g).tolist())
    Pair(st).step(sel_of(torch.randperm(190, generator=g)[: min(misses, B)].tolist()), [0], now=span)


def test_padding_and_uneven_lengths():
    st = make_state(S=4, B=6, L=48, TT=6, tail_start=[42, 10, 0, 25])
    sel = torch.tensor([[[-1, -1, -1], [-1, -1, -1], [-1, -1, -1]],  # a request with nothing selected
                        [[0, 11, -1], [14, 3, 3], [-1, 15, 12]],
                        [[1, 5, 2], [4, -1, 3], [0, 5, -1]]])  # slot 2: tail_start 0, all tail
    Pair(st).step(sel, [0, 1, 2], now=3)


def test_repeated_steps_with_eviction():
    st = make_state(S=3, B=6, L=40, TT=4)
    p, g = Pair(st), torch.Generator().manual_seed(5)
    for now in range(10):
        sel = torch.randint(-1, 40, (2, 2, 3), generator=g)
        p.step(sel, [2, 0] if now % 2 else [0, 1], now)


def test_duplicates_across_and_within_queries():
    st = make_state(S=2, B=16)
    fill_hot(st, 0, [6, 40, 41], [1, 0, 0])
    want, _ = Pair(st).step(sel_of([1, 2, 3, 4, 1], [3, 4, 5, 6, 6], [6, 1, 7, -1, 2], [2, 2, 2, 2, 2]), [0], now=4)
    assert want.counters.host == 6 and want.counters.hot == 1


def test_direct_map_tail_and_overflow():
    st = make_state(S=2, B=3, L=32, TT=4, direct=True)
    st.direct_loc[1, 4:8] = torch.tensor([100, -1, 102, 103])
    fill_hot(st, 1, [6, 9, 13], [2, 0, 1])  # 6 is direct: its slot is not protected
    want, _ = Pair(st).step(sel_of([4, 5, 6, 9, 29, 30, 1, 2, 3, 10]), [1], now=5)
    assert want.counters.overflow > 0 and want.counters.direct == 4


def test_deferred_plan_and_launch():
    st = make_state(S=2, B=6)
    sel = sel_of([1, 2, 3], [3, 4, 9])
    host, dev = host_rows_for(st, 0), dev_rows_for(st, 0)
    p = Pair(st)
    _, got = p.step(sel, [1], now=1, defer=True)
    d = dev.to(DEV)
    launch_copies(got, host.pin_memory() if DEV == "cuda" else host, d)
    assert_rows_right(got, sel, torch.tensor([1]), d.cpu(), 0)


@pytest.mark.parametrize("dtype,width", [(torch.float64, W), (torch.float16, 5), (torch.uint8, 7),
                                         (torch.bfloat16, 576)])
def test_run_copies_matches_reference(dtype, width):
    st = make_state(S=3, B=8, L=32, TT=4, seed=2)
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 100, (st.host_table.numel() + 1, 4, width), generator=g).to(dtype)
    dev = torch.zeros(8, 8, width, dtype=dtype)
    big = torch.zeros(8, 12, width, dtype=dtype)  # non-contiguous page stride
    sel = torch.randint(-1, 28, (2, 2, 5), generator=g)
    p = Pair(st)
    want, got = p.step(sel, [0, 2], now=1)
    ref_dev = dev.clone()
    nbytes = run_copies(want, host, ref_dev)
    src = host.pin_memory() if DEV == "cuda" else host
    for target in (dev.to(DEV), big.to(DEV)[:, 2:10]):
        assert run_copies_triton(got, src, target) == nbytes
        assert torch.equal(target.cpu(), ref_dev)
    d = dev.to(DEV)  # a reference plan through the Triton copy
    assert run_copies_triton(plan_reference(sel, torch.tensor([0, 2]), clone_state(st), 1), src, d) == nbytes


def test_layered_copy_serves_a_layer_group():
    """One launch over [pages, G, ps, W] row spaces (a layer group; a strided slice of the layer
    axis) copies every layer's rows exactly as the per-layer reference copy does."""
    st = make_state(S=3, B=8, L=32, TT=4, seed=3)
    g = torch.Generator().manual_seed(1)
    host = torch.randint(0, 100, (st.host_table.numel() + 1, 5, 4, 9), generator=g).to(torch.float16)
    sel = torch.randint(-1, 28, (2, 2, 5), generator=g)
    want, got = Pair(st).step(sel, [0, 2], now=1, defer=True)
    dev = torch.zeros(8, 6, 8, 9, dtype=torch.float16, device=DEV)
    src = host.pin_memory() if DEV == "cuda" else host
    launch_copies(got, src[:, 1:4], dev[:, 2:5])
    for i in range(3):
        ref = torch.zeros(8, 8, 9, dtype=torch.float16)
        run_copies(want, host[:, 1 + i], ref)
        assert torch.equal(dev[:, 2 + i].cpu(), ref)
    assert not dev[:, [0, 1, 5]].any()


def test_stale_claims_never_resolve_a_row():
    """The claim table pv is never cleared: filled with every kind of stale value (uids of this
    call's entries that hold other positions, of padding, out of range, negative), plans stay
    exact. Without the kernel's sel[u] == hot_pos check a stale uid would turn a miss into a hit."""
    g = torch.Generator().manual_seed(5)
    st, p, ws = stale_claims_rig()
    for now in range(4):
        sel = torch.randint(-1, 48, (2, 3, 6), generator=g)
        sel[0, 0, :3] = torch.tensor([1, 30, -1])  # hits among the stale cells
        plan_triton(sel.to(DEV), torch.tensor([0, 2], device=DEV), clone_state(st, DEV), 0, workspace=ws)
        for pv in ws.claims():
            pv.copy_(torch.randint(-3, 3 * 6 + 3, pv.shape, generator=g).to(pv))
        p.step(sel, [0, 2], now=4 + now, ws=ws)


def stale_claims_rig():
    """(state, Pair, workspace) of the stale-claim tests: 3 slots of 8 hot rows over 48 positions,
    slot 0 with hot positions at both ends of the range, slot 2 with four at the same stamp."""
    st = make_state(S=3, B=8, L=48, TT=4)
    fill_hot(st, 0, [1, 2, 3, 30, 31, 40, 41], [0, 0, 1, 2, 3, 1, 2])
    fill_hot(st, 2, [5, 6, 7, 8], [1, 1, 1, 1])
    return st, Pair(st), PlanWorkspace(DEV)


def random_state(g, S, B, L, TT, direct, fill, seed):
    """(state, top [S]): random tail starts, a `fill` share of each slot's hot cache holding distinct
    positions < top (tail start + TT) with random stamps, and (direct) a random optional map."""
    ts = torch.randint(0, L + 1, (S,), generator=g)
    st = make_state(S=S, B=B, L=L + TT, TT=TT, tail_start=ts, direct=direct, seed=seed)
    top = ts + TT  # positions < tail_start + TT exist
    for s in range(S):
        nf = int(fill * min(B, int(top[s])))
        st.hot_pos[s, :nf] = torch.randperm(int(top[s]), generator=g)[:nf]
        st.hot_pos[s] = st.hot_pos[s, torch.randperm(B, generator=g)]
        st.hot_stamp[s] = torch.where(st.hot_pos[s] >= 0, torch.randint(-1, 6, (B,), generator=g), -1)
        if direct:
            m = torch.rand(L + TT, generator=g) < 0.3
            st.direct_loc[s] = torch.where(m, 500 + torch.arange(L + TT), -1)
    return st, top


@pytest.mark.parametrize("hot_map", [False, True], ids=["scan", "index"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=hs.integers(1, 5), K=hs.integers(1, 4), k=hs.integers(1, 12), B=hs.integers(1, 24), L=hs.integers(8, 64),
       TT=hs.integers(1, 8), direct=hs.booleans(), fill=hs.floats(0, 1), steps=hs.integers(1, 3),
       seed=hs.integers(0, 2**31 - 1))
def test_random_against_reference(hot_map, S, K, k, B, L, TT, direct, fill, steps, seed):
    """Unions with repeated positions; `index`: the state keeps the hot_entry index (the claims
    deduplicate, the index finds the hits: tests/test_resolver_hot_entry.py)."""
    g = torch.Generator().manual_seed(seed)
    st, top = random_state(g, S, B, L, TT, direct, fill, seed)
    p = Pair(st, hot_map=hot_map)
    for step in range(steps):
        N = int(torch.randint(1, S + 1, (1,), generator=g))
        slots = torch.randperm(S, generator=g)[:N]
        hi = top[slots].view(N, 1, 1)
        sel = (torch.rand(N, K, k, generator=g) * hi).long()
        sel = torch.where(torch.rand(N, K, k, generator=g) < 0.15, -1, sel)
        p.step(sel, slots, now=6 + step)


# -- direct fast path (P0): requests whose valid rows all resolve through the tail / optional map ----

def _direct_state(S=4, B=6, L=40, TT=6, seed=3):
    """Optional map ready for even positions < 24 (locations 200 + p), tail from position L - TT;
    slot 1's map is not injective (two positions share a location)."""
    st = make_state(S=S, B=B, L=L, TT=TT, direct=True, seed=seed)
    st.direct_loc[:, 0:24:2] = 200 + torch.arange(0, 24, 2)
    st.direct_loc[1, 4] = st.direct_loc[1, 6]
    for s in range(S):  # the hot cache also holds some direct positions, with old stamps
        fill_hot(st, s, [2, 4, 5, 7, 31][: B], [3, 1, 0, 2, 4][: B])
    return st


def test_all_direct_batch_keeps_state():
    st = _direct_state()
    tail = st.tail_start  # 34: positions 34..39 in the tail
    sel = torch.tensor([[[2, 4, 6, 34, -1], [4, 4, 39, 2, -1]],  # duplicates within and across queries
                        [[4, 6, 8, -1, -1], [-1, -1, -1, -1, 35]],  # slot 1: 4 and 6 share a location
                        [[-1, -1, -1, -1, -1], [-1, -1, -1, -1, -1]]])  # nothing selected
    assert int(tail[0]) == 34
    p = Pair(st)
    before = (p.dev.hot_pos.clone(), p.dev.hot_stamp.clone())
    want, got = p.step(sel, [0, 1, 3], now=9)
    assert want.counters == (12, 9, 0, 0, 0, 0)
    assert got.copy_n.tolist() == [0, 0, 0] and got.copy_src.numel() == 0
    assert torch.equal(p.dev.hot_pos.cpu(), before[0].cpu()) and torch.equal(p.dev.hot_stamp.cpu(), before[1].cpu())


def test_mixed_batch_direct_and_full_requests():
    st = _direct_state()
    sel = torch.tensor([[[2, 4, 6, 36], [8, 2, -1, 37]],  # all direct
                        [[2, 5, 7, 9], [4, 11, 31, -1]],  # hot hits (5, 7, 31), misses (9, 11), direct (2, 4)
                        [[0, 34, -1, -1], [-1, -1, -1, -1]],  # all direct (tail + map)
                        [[1, 3, 34, 35], [36, 37, 38, 39]]])  # misses then tail
    p = Pair(st)
    p.step(sel, [2, 0, 1, 3], now=7)
    p.step(sel.flip(0), [3, 1, 0, 2], now=8)  # same rows, other slots: direct rows now of other requests


def test_direct_tail_row_without_location_is_not_direct():
    """A tail position whose tail_loc is -1 is not direct: the request takes the full path."""
    st = _direct_state()
    st.tail_loc[0, 2] = -1
    Pair(st).step(sel_of([2, 4, 36, 35], [34, -1, -1, -1]), [0], now=5)


def test_direct_without_map_all_tail():
    st = make_state(S=2, B=4, L=32, TT=8)  # no optional map: only the tail is direct
    fill_hot(st, 0, [25, 3], [1, 2])
    p = Pair(st)
    want, _ = p.step(torch.tensor([[[24, 25, 31, -1]], [[30, 30, 29, -1]]]), [0, 1], now=4)
    assert want.counters == (6, 5, 0, 0, 0, 0)


def test_direct_distinct_count_exact_with_duplicates():
    """Many duplicates (within a chunk and across chunks) and a map that is not injective: the
    direct path's bitmap count and the full path's claims both count distinct rows exactly."""
    st = make_state(S=2, B=4, L=96, TT=8, direct=True)
    st.direct_loc[:, :88] = 1000 + torch.arange(88) % 7  # not injective either
    g = torch.Generator().manual_seed(4)
    p = Pair(st)
    for now in range(3):
        sel = torch.randint(-1, 96, (2, 3, 17), generator=g)
        p.step(sel, [1, 0], now=now)


@pytest.mark.skipif(DEV == "cuda", reason="interpreter-only probe")
def test_all_direct_skips_dedup_and_scan(monkeypatch):
    """Under the interpreter the helpers are looked up at call time: an all-direct batch must not
    reach the hot scan or the miss phase; a batch with a hot row must."""
    import dhisparse.kernels.resolver_kernel as rk
    import dhisparse.kernels.resolver_one as ro

    st = _direct_state()
    sel = torch.tensor([[[2, 4, 36, -1]], [[-1, -1, -1, -1]]])
    for mod, name in ((rk, "_pair_misses"), (rk, "_hot_scan"), (ro, "_pair_misses"), (ro, "_hot_scan_one")):
        monkeypatch.setattr(mod, name, _boom)
    Pair(st).step(sel, [0, 1], now=3)
    with pytest.raises(Exception, match="full resolver path taken"):
        Pair(st).step(sel_of([2, 5]), [0], now=3)


def test_deferred_direct_plan_does_not_sync(monkeypatch):
    """plan_triton(defer=True) reads nothing back from the device: .item, .tolist, bool() and int()
    of a tensor are forbidden during the call (on CUDA the sync debug mode also errors)."""
    st = _direct_state()
    dev = clone_state(st, DEV)
    sel = torch.tensor([[[2, 4, 36, -1]], [[8, 8, 39, 0]]], device=DEV)
    slots = torch.tensor([0, 2], device=DEV)

    def forbid(name):
        def f(self, *a, **k):
            if self.device.type == DEV and self.numel() > 0 and (DEV == "cuda" or self.data_ptr() in watched):
                raise AssertionError(f"{name} on a device tensor during a deferred plan")
            return orig[name](self, *a, **k)
        return f

    watched = {t.data_ptr() for t in (dev.hot_pos, dev.hot_stamp, dev.hot_loc, dev.tail_start, dev.tail_loc,
                                      dev.host_table, dev.direct_loc, sel, slots)}
    orig = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__int__")}
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with monkeypatch.context() as m:
            for n in orig:
                m.setattr(torch.Tensor, n, forbid(n))
            plan = plan_triton(sel, slots, dev, 5, defer=True)
    finally:
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert plan.deferred
    ref = plan_reference(sel.cpu(), slots.cpu(), clone_state(st), 5)
    assert torch.equal(plan.loc.cpu(), ref.loc) and plan.materialize().counters == ref.counters


@pytest.mark.parametrize("seed", range(6))
def test_random_mostly_direct_batches(seed):
    """Random ragged batches where most requests are all-direct and a few hit the hot cache / host."""
    g = torch.Generator().manual_seed(seed)
    S, L, TT = 5, 48, 6
    B = int(torch.randint(1, 12, (1,), generator=g))
    st = make_state(S=S, B=B, L=L, TT=TT, direct=True, seed=seed)
    dense = torch.rand(S, generator=g) < 0.6  # these slots have every history row ready
    for s in range(S):
        m = torch.ones(L, dtype=torch.bool) if dense[s] else torch.rand(L, generator=g) < 0.5
        st.direct_loc[s] = torch.where(m, 300 + torch.arange(L), -1)
        nf = min(B, 10)
        st.hot_pos[s, :nf] = torch.randperm(L - TT, generator=g)[:nf]
        st.hot_stamp[s, :nf] = torch.randint(0, 5, (nf,), generator=g)
    p = Pair(st)
    for step in range(3):
        N = int(torch.randint(1, S + 1, (1,), generator=g))
        K, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        sel = torch.randint(0, L, (N, K, k), generator=g)
        sel = torch.where(torch.rand(N, K, k, generator=g) < 0.2, -1, sel)
        p.step(sel, torch.randperm(S, generator=g)[:N], now=10 + step)


def test_direct_distinct_count_across_chunks():
    """K*k = 4500 entries (five chunks of the direct path): duplicates within and across chunks and
    positions at every bit of a bitmap word (p % 32 == 31 included) count once each, and the
    bitmap half the next call uses is zero again after each call (P0's programs zero the half their
    call does not use; the plan kernel flips the parity). The second call selects the same rows:
    bits left from the first would count them as seen."""
    L = 1600
    st = make_state(S=2, B=4, L=L, TT=8, direct=True)
    st.direct_loc[:] = 5000 + torch.arange(L)
    g = torch.Generator().manual_seed(7)
    sel = torch.randint(-1, L, (2, 3, 1500), generator=g)
    sel[:, 0] = torch.randint(-1, 800, (2, 1500), generator=g)  # the first chunk's words: positions < 800 only
    sel[0, 2, :64] = torch.arange(31, 31 + 32 * 64, 32)[:64].clamp(max=L - 1)  # word-top bits
    p, ws = Pair(st), PlanWorkspace(DEV)
    for now in (2, 3):  # with a persistent workspace
        want, _ = p.step(sel if now == 2 else sel.flip(2), [1, 0], now=now, ws=ws)
        assert want.counters.direct == sum(len(set(sel[n][sel[n] >= 0].tolist())) for n in range(2))
        assert want.counters.hot == want.counters.host == 0
        assert ws.zeroed() and all(int(b.abs().sum()) == 0 for b in ws.zeroed()), now


@pytest.mark.parametrize("direct", [False, True])
def test_a_persistent_workspace_is_left_zeroed_and_plans_stay_exact(direct):
    """plan_triton(workspace=ws) over ragged batches that grow and shrink, all-direct requests among
    them: every plan equals the reference, and after every call the bitmap and P0 counts of the
    workspace are zero again (the kernels clear what they set), including a grown-out buffer; the
    claim tables are left as the kernel wrote them (never cleared)."""
    g = torch.Generator().manual_seed(11)
    S, L, TT = 5, 80, 6
    st = make_state(S=S, B=7, L=L, TT=TT, direct=direct, seed=4)
    if direct:
        for s in range(S):
            m = torch.ones(L, dtype=torch.bool) if s < 2 else torch.rand(L, generator=g) < 0.5
            st.direct_loc[s] = torch.where(m, 300 + torch.arange(L), -1)
    p, ws = Pair(st), PlanWorkspace(DEV)
    for step, N in enumerate((2, 5, 1, 4, 5)):
        K, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
        sel = torch.where(torch.rand(N, K, k, generator=g) < 0.2, -1, torch.randint(0, L, (N, K, k), generator=g))
        p.step(sel, torch.randperm(S, generator=g)[:N], now=step, defer=step % 2 == 1, ws=ws)
        assert len(ws.zeroed()) >= 2 * direct and all(int(b.abs().sum()) == 0 for b in ws.zeroed()), step
        assert ws.claims(), step
    assert any(name == ("bm" if direct else "pv_int16") for name, _ in ws._retired)  # grew past the first


def test_a_selection_past_the_packed_counts_is_refused_by_name():
    """K*k above 65,535 (the plan kernel counts a request's rows in 16-bit fields) is a ValueError
    naming K*k, before anything is launched."""
    st = make_state(S=1, B=4, L=40, TT=4)
    with pytest.raises(ValueError, match=r"K\*k must be at most 65535"):
        plan_triton(torch.zeros((1, 33, 2000), dtype=torch.int64), torch.zeros(1, dtype=torch.int64), st, 0)


def test_kept_state_follows_a_grown_host_table_and_a_new_map():
    """A store keeps one ResolverState a group and swaps in a reallocated host table
    (`HierarchicalKV.resolver_state`); the plan's cached state arguments (`resolver_args.state_args`:
    row strides, the positions' bound) must follow the new tensors, not the ones first seen."""
    st = make_state(S=2, B=8, L=32, TT=4, seed=5)
    p = Pair(st)
    p.step(sel_of([1, 2, 3], [4, 5, -1]), [0], now=1)
    for s in (p.ref, p.dev):  # the history outgrew the table: a wider one, same object state
        wide = torch.cat([s.host_table, 100 + torch.arange(2 * 8, dtype=s.host_table.dtype,
                                                           device=s.host_table.device).view(2, 8)], 1)
        s.host_table = wide
        s.tail_start = torch.full_like(s.tail_start, 60)
    want, _ = p.step(sel_of([40, 41, 55], [58, 2, -1]), [1], now=2)  # positions past the old table's reach
    assert want.counters.host == 5
    for s in (p.ref, p.dev):  # an optional map appears on the same state (adaptive sets direct_loc a call)
        s.direct_loc = torch.full((2, 64), -1, dtype=torch.int64, device=s.hot_pos.device)
        s.direct_loc[1, 50:60] = 7000 + torch.arange(10, device=s.hot_pos.device)
    want, _ = p.step(sel_of([50, 51, 20], [59, 3, -1]), [1], now=3)
    assert want.counters.direct == 3 and want.counters.host == 2


def test_state_rows_must_be_contiguous_in_their_last_dimension():
    st = clone_state(make_state(S=2, B=8, L=32, TT=4), DEV)
    st.host_table = st.host_table.t().contiguous().t()  # [S, pages] with a unit row stride
    with pytest.raises(ValueError, match="host_table"):
        plan_triton(sel_of([1, 2], [3, 4]).to(DEV), torch.tensor([0], device=DEV), st, 1)


def test_positions_past_the_packed_claim_bound_are_refused():
    """The plan packs a claimed position and a direct flag into an int32 ((p << 1) | flag in P3's
    gather), so a state whose positions reach past 2^30 (host table width x page size + tail) is a
    ValueError naming host_table, not a silent alias."""
    st = clone_state(make_state(S=2, B=8, L=32, TT=4), DEV)
    st.host_page_size = 1 << 28  # 8 pages a row: 2^31 positions
    with pytest.raises(ValueError, match="host_table / direct_loc: positions up to"):
        plan_triton(sel_of([1, 2], [3, 4]).to(DEV), torch.tensor([0], device=DEV), st, 1)


def test_a_hot_cache_past_the_packed_victim_ranks_is_refused_by_name():
    """The victims' running counts are packed 16 bits each (`resolver_evict._victims`): more than
    32,768 hot rows a slot is a ValueError naming hot_pos, before anything is launched."""
    st = make_state(S=1, B=4, L=40, TT=4)
    st.hot_pos = torch.full((1, 32769), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="hot_pos: at most 32768 hot rows"):
        plan_triton(torch.zeros((1, 1, 4), dtype=torch.int64), torch.zeros(1, dtype=torch.int64), st, 0)
