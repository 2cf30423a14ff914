"""The fused Triton resolver against the PyTorch reference, bit for bit (TRITON_INTERPRET on CPU).

Outputs (locations, copy plan, counters) and state mutations (hot_pos, hot_stamp) must be equal.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from test_resolver_reference import (  # noqa: E402
    W, assert_rows_right, clone_state, dev_rows_for, host_rows_for, make_state, sel_of)

from dhisparse.kernels.resolver import launch_copies, plan_triton, run_copies_triton  # noqa: E402
from dhisparse.kv.resolver import plan_reference, run_copies  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class Pair:
    """A reference state (CPU) and a kernel state (DEV) stepped together and compared exactly."""

    def __init__(self, st):
        self.ref, self.dev = clone_state(st), clone_state(st, DEV)

    def step(self, sel, slots, now, defer=False):
        slots = torch.as_tensor(slots)
        want = plan_reference(sel, slots, self.ref, now)
        got = plan_triton(sel.to(DEV), slots.to(DEV), self.dev, now, defer=defer)
        if defer:
            assert got.counters is None
            got.materialize()
        assert torch.equal(got.loc.cpu(), want.loc), (got.loc, want.loc)
        assert torch.equal(got.copy_src.cpu(), want.copy_src), (got.copy_src, want.copy_src)
        assert torch.equal(got.copy_dst.cpu(), want.copy_dst), (got.copy_dst, want.copy_dst)
        assert got.counters == want.counters
        assert torch.equal(self.dev.hot_pos.cpu(), self.ref.hot_pos)
        assert torch.equal(self.dev.hot_stamp.cpu(), self.ref.hot_stamp)
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


@pytest.mark.parametrize("rounds", [0, 1])
def test_leftover_fallback_is_exact(monkeypatch, rounds):
    """With few (or no) hash rounds most rows go through the exact one-at-a-time fallback."""
    import dhisparse.kernels.resolver as kr

    monkeypatch.setattr(kr, "MAX_ROUNDS", rounds)
    st = make_state(S=3, B=10, L=40, TT=4)
    fill_hot(st, 0, [1, 2, 3, 30, 31], [0, 0, 1, 2, 3])
    p, g = Pair(st), torch.Generator().manual_seed(9)
    for now in range(3):
        p.step(torch.randint(-1, 40, (2, 3, 6), generator=g), [0, 2], now=4 + now)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=hs.integers(1, 5), K=hs.integers(1, 4), k=hs.integers(1, 12), B=hs.integers(1, 24), L=hs.integers(8, 64),
       TT=hs.integers(1, 8), direct=hs.booleans(), fill=hs.floats(0, 1), steps=hs.integers(1, 3),
       seed=hs.integers(0, 2**31 - 1))
def test_random_against_reference(S, K, k, B, L, TT, direct, fill, steps, seed):
    g = torch.Generator().manual_seed(seed)
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
    p = Pair(st)
    for step in range(steps):
        N = int(torch.randint(1, S + 1, (1,), generator=g))
        slots = torch.randperm(S, generator=g)[:N]
        hi = top[slots].view(N, 1, 1)
        sel = (torch.rand(N, K, k, generator=g) * hi).long()
        sel = torch.where(torch.rand(N, K, k, generator=g) < 0.15, -1, sel)
        p.step(sel, slots, now=6 + step)
