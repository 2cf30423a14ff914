"""The victims' threshold by radix selection (`VICTIM_SELECT = 1`: resolver_evict._radix_threshold, an issue-33
experiment) gives exactly the reference's plan and state, like the default walk and bisection: the LRU-oldest
unprotected slots by (stamp, slot), over stamp spans of one to eight 8-bit digits, ties, empty slots (-1)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from test_resolver_kernel import Pair, fill_hot
from test_resolver_reference import make_state, sel_of

import dhisparse.kernels.resolver as kr
import dhisparse.kernels.resolver_evict as ev

# stamp spans (the reference keys stamp * (B + 1), so stamps stay far below 2^63, as step counts do)
SPANS = {"one_digit": 200, "two_digits": 60_000, "three_digits": 1 << 20, "wide": 1 << 40}


@pytest.fixture(params=[0, 1], ids=["walk", "radix"])
def select(request, monkeypatch):
    monkeypatch.setattr(kr, "VICTIM_SELECT", request.param)
    return request.param


@pytest.mark.parametrize("span", list(SPANS))
@pytest.mark.parametrize("misses", [1, 5, 13, 19])
def test_victims_over_every_span(select, span, misses):
    """20 slots with distinct random stamps in [0, span) (two pairs tied), 4 free slots (stamp -1),
    three hits on the newest rows; `misses` misses evict the oldest unprotected slots."""
    B, hi = 24, SPANS[span]
    g = torch.Generator().manual_seed(misses * 7 + len(span))
    stamps = (torch.rand(20, generator=g, dtype=torch.float64) * (hi - 2)).long()
    stamps[3], stamps[11] = stamps[7], stamps[5]  # ties: broken by slot id
    perm = torch.randperm(B, generator=g)
    st = make_state(S=2, B=B, L=64, TT=4)
    fill_hot(st, 1, (40 + perm[:20]).tolist(), [0] * 20)
    st.hot_stamp[1, perm[:20]] = stamps
    newest = stamps.argsort(descending=True)[:3]
    hits = [40 + int(perm[i]) for i in newest]
    sel = sel_of(hits + [int(x) for x in torch.randperm(30, generator=g)[:misses]])
    want, _ = Pair(st).step(sel, [1], now=hi)
    assert want.counters.host == misses


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(B=hs.integers(2, 40), nhot=hs.integers(0, 40), misses=hs.integers(1, 40), span=hs.sampled_from(list(SPANS.values())),
       groups=hs.integers(1, 6), seed=hs.integers(0, 2**31 - 1))
def test_radix_select_against_reference(select, B, nhot, misses, span, groups, seed):
    """Random caches: stamps from `groups` distinct values over [0, span) (so groups of ties), some slots
    empty; hits on random held positions; misses up to more than the cache holds (overflow)."""
    g = torch.Generator().manual_seed(seed)
    st = make_state(S=1, B=B, L=128, TT=4)
    held = min(B, 100)
    pos = torch.randperm(100, generator=g)[:held]
    vals = (torch.rand(groups, generator=g, dtype=torch.float64) * (span - 2)).long()
    st.hot_pos[0, :held] = pos
    st.hot_stamp[0, :held] = vals[torch.randint(0, groups, (held,), generator=g)]
    free = torch.rand(B, generator=g) < 0.2
    st.hot_pos[0, free], st.hot_stamp[0, free] = -1, -1
    hits = [int(p) for p in st.hot_pos[0][st.hot_pos[0] >= 0][: min(nhot, held)]]
    fresh = [int(p) for p in 100 + torch.randperm(24, generator=g)[: min(misses, 24)]]
    want, _ = Pair(st).step(sel_of(hits + fresh), [0], now=span)
    assert want.counters.host + want.counters.overflow == len(fresh)


@triton.jit
def _boom(*args):
    """Stands in for `_radix_threshold` in test_the_setting_picks_the_path."""
    tl.static_assert(False, "radix threshold taken")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only probe")
@pytest.mark.parametrize("choice", [0, 1])
def test_the_setting_picks_the_path(monkeypatch, choice):
    """VICTIM_SELECT 1 reaches `_radix_threshold` when the oldest stamp group does not cover the misses;
    0 never does (the walk and bisection)."""
    monkeypatch.setattr(kr, "VICTIM_SELECT", choice)
    monkeypatch.setattr(ev, "_radix_threshold", _boom)
    st = make_state(S=1, B=8, L=64, TT=4)
    fill_hot(st, 0, [1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7])  # distinct stamps: no group covers 3
    if choice:
        with pytest.raises(Exception, match="radix threshold taken"):
            Pair(st).step(sel_of([20, 21, 22]), [0], now=9)
    else:
        Pair(st).step(sel_of([20, 21, 22]), [0], now=9)
