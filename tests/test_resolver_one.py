"""The plan kernel's registers-only path (resolver_one.py: K*k <= 2,048) and its `distinct` contract,
against the PyTorch reference bit for bit (TRITON_INTERPRET on CPU).

test_resolver_kernel.py's cases with K*k <= 2,048 already run this path with deduplication; here: one
top-k query a request with distinct=True (no claims read-back), stale claim tables, and the chunked
path next to it on the same state. Breakages tried (each fails a test here): the slot-side check of
the gathered position (tl.gather(p, uc) == hp) dropped; the gathered direct location's test (< 0)
dropped; the host page prefetch masked to direct rows; every entry its own representative without
distinct=True (the duplicates test); the packed gather's direct bit ignored (q & 1); the host-selected
count of a distinct plan taken as 0 instead of its copied rows (session 31: P5 reads no flags under
distinct). Not catchable by results, and so not claimed: `_min_count` dropping the right operand's count
only sends the victim search from its walk to its bisection (the same victims, more rounds).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from test_resolver_kernel import DEV, Pair, fill_hot, random_state, stale_claims_rig  # noqa: E402
from test_resolver_reference import clone_state, make_state  # noqa: E402

from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402


def _distinct_sel(g, N, k, hi, pad=0.15):
    """[N, 1, k]: per request k distinct positions < hi[n] (fewer where hi[n] < k), -1 padded."""
    sel = torch.full((N, 1, k), -1, dtype=torch.int64)
    for n in range(N):
        take = torch.randperm(int(hi[n]), generator=g)[:k]
        sel[n, 0, : take.numel()] = take
        sel[n, 0] = sel[n, 0, torch.randperm(k, generator=g)]
    return torch.where(torch.rand(N, 1, k, generator=g) < pad, -1, sel)


def distinct_steps(p: Pair, g, S, k, top, steps, ws, scramble=None, **kw):
    """`steps` calls of one distinct top-k query a request (random requests of S slots, positions < top of
    their slot) on pair p through workspace ws, each compared by p; scramble(ws) between calls."""
    for step in range(steps):
        N = int(torch.randint(1, S + 1, (1,), generator=g))
        slots = torch.randperm(S, generator=g)[:N]
        p.step(_distinct_sel(g, N, k, top[slots]), slots, now=6 + step, ws=ws, distinct=True, **kw)
        if scramble is not None:
            scramble(ws)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=hs.integers(1, 5), k=hs.integers(1, 16), B=hs.integers(1, 24), L=hs.integers(8, 64), TT=hs.integers(1, 8),
       direct=hs.booleans(), fill=hs.floats(0, 1), steps=hs.integers(1, 3), seed=hs.integers(0, 2**31 - 1))
def test_distinct_one_query_against_reference(S, k, B, L, TT, direct, fill, steps, seed):
    """distinct=True on one top-k query a request: the same plans and state as the reference."""
    g = torch.Generator().manual_seed(seed)
    st, top = random_state(g, S, B, L, TT, direct, fill, seed)

    def stale(ws):  # stale claims of every kind between calls
        for pv in ws.claims():
            pv.copy_(torch.randint(-3, k + 3, pv.shape, generator=g).to(pv))

    distinct_steps(Pair(st), g, S, k, top, steps, PlanWorkspace(DEV), stale)


def test_distinct_with_stale_claims_and_hits_among_them():
    """Hot positions whose claim cells hold this call's uids of other positions stay misses."""
    g = torch.Generator().manual_seed(11)
    st, p, ws = stale_claims_rig()
    for now in range(4):
        sel = _distinct_sel(g, 2, 6, torch.tensor([44, 44]), pad=0.2)
        sel[0, 0, :2] = torch.tensor([1, 30])
        sel[0, 0, 2:] = torch.where(torch.isin(sel[0, 0, 2:], torch.tensor([1, 30])), -1, sel[0, 0, 2:])
        plan_triton(sel.to(DEV), torch.tensor([0, 2], device=DEV), clone_state(st, DEV), 0, workspace=ws)
        for pv in ws.claims():
            pv.copy_(torch.randint(-3, 9, pv.shape, generator=g).to(pv))
        p.step(sel, [0, 2], now=4 + now, ws=ws, distinct=True)


def test_registers_path_and_chunked_path_agree_on_one_state():
    """A K*k of 2,048 (registers) and of 2,049+ (chunks) alternate on one hot cache: both exact."""
    g = torch.Generator().manual_seed(2)
    st = make_state(S=2, B=64, L=6000, TT=8)
    fill_hot(st, 1, list(range(0, 128, 2))[:64], [int(v) for v in torch.randint(0, 5, (64,), generator=g)])
    p = Pair(st)
    for now, (K, k) in enumerate(((1, 2048), (2, 1100), (1, 2000), (3, 700))):
        sel = torch.randint(-1, 6000, (2, K, k), generator=g)
        p.step(sel, [1, 0], now=10 + now)


def test_the_engine_checks_the_distinct_contract_in_debug_mode():
    """kv/hier/resolver_step.py passes distinct=True for one query a request; with debug checks a repeated
    position is refused by name instead of planned wrong."""
    import pytest

    from dhisparse.kv.hier.resolver_step import _check_distinct

    _check_distinct(torch.tensor([[[3, -1, 5, -1, 0]], [[-1, -1, -1, -1, -1]]]))
    with pytest.raises(AssertionError, match=r"repeats a position \(requests \[1\]\)"):
        _check_distinct(torch.tensor([[[3, -1, 5, -1, 0]], [[7, 2, -1, 7, 1]]]))
