"""The plan kernel's fused copy (`plan_triton(copy=...)`, P6): one launch plans and copies, with the same
plan, state and device rows as the reference's plan + `run_copies` (TRITON_INTERPRET on CPU).

Both plan paths (registers-only for K*k <= 2,048, chunked above), layered row spaces (a layer group),
ragged batches (padding, all-direct requests, empty hot caches), hypothesis over states and steps.
Breakages tried (each fails a test here): P6 given copy_n - 1 rows (the last planned row of a request
is not copied); the layer loop stopping after layer 0 (`g < CG` -> `g < 1`); the copy placed before
P4's assignment (the copy plan is not yet written: stale rows); `copied` left False (the engine would
copy twice: test_a_fused_plan_says_it_copied).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from test_resolver_kernel import DEV, Pair, fill_hot, random_state  # noqa: E402
from test_resolver_reference import clone_state, make_state  # noqa: E402

from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import plan_reference, run_copies  # noqa: E402


def _rows(st, layers: int, width: int, seed: int):
    """(host [HP, G, 4, width], device [P, G, 8, width]) float32 row spaces: random host rows, device rows
    at a fill value (tail and direct rows never move, so any content checks them)."""
    g = torch.Generator().manual_seed(seed)
    hp = int(st.host_table.max()) + 1
    host = torch.randint(0, 1 << 20, (hp, layers, st.host_page_size, width), generator=g).to(torch.float32)
    top = 1 + max(int(st.hot_loc.max()), int(st.tail_loc.max()))
    dev = torch.full((-(-top // 8), layers, 8, width), -1.0)
    return host, dev


def _fused_step(pair: Pair, sel, slots, now, host, dev_ref, dev_got, ws=None, distinct=False):
    """One call of each side: the reference plan + run_copies into every layer of dev_ref, the fused
    plan into dev_got; plans and states compared by Pair's own checks, then the rows."""
    slots = torch.as_tensor(slots)
    want = plan_reference(sel, slots, pair.ref, now)
    src = host.pin_memory() if DEV == "cuda" else host
    got = plan_triton(sel.to(DEV), slots.to(DEV), pair.dev, now, workspace=ws, distinct=distinct,
                      copy=(src, dev_got))
    assert got.copied
    for name in ("loc", "copy_src", "copy_dst"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert got.counters == want.counters
    assert torch.equal(pair.dev.hot_pos.cpu(), pair.ref.hot_pos)
    assert torch.equal(pair.dev.hot_stamp.cpu(), pair.ref.hot_stamp)
    for layer in range(host.shape[1]):
        run_copies(want, host[:, layer], dev_ref[:, layer])
    assert torch.equal(dev_got.cpu(), dev_ref)
    return want


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=hs.integers(1, 4), K=hs.integers(1, 3), k=hs.integers(1, 12), B=hs.integers(1, 20), L=hs.integers(8, 48),
       TT=hs.integers(1, 6), direct=hs.booleans(), fill=hs.floats(0, 1), layers=hs.integers(1, 3),
       width=hs.sampled_from([1, 3, 8, 70]), steps=hs.integers(1, 3), seed=hs.integers(0, 2**31 - 1))
def test_fused_copy_matches_plan_then_copy(S, K, k, B, L, TT, direct, fill, layers, width, steps, seed):
    g = torch.Generator().manual_seed(seed)
    st, top = random_state(g, S, B, L, TT, direct, fill, seed)
    host, dev = _rows(st, layers, width, seed)
    pair, got = Pair(st), dev.clone().to(DEV)
    for step in range(steps):
        N = int(torch.randint(1, S + 1, (1,), generator=g))
        slots = torch.randperm(S, generator=g)[:N]
        sel = torch.randint(-1, int(top.max()), (N, K, k), generator=g)
        sel = torch.where(sel < top[slots][:, None, None], sel, -1)
        _fused_step(pair, sel, slots, now=6 + step, host=host, dev_ref=dev, dev_got=got)


def test_chunked_path_and_many_misses_copy_every_row():
    """K*k past 2,048 (the chunked path) with more misses than one P6 chunk, two layers, then the
    registers-only path with distinct=True on the same hot cache."""
    g = torch.Generator().manual_seed(5)
    st = make_state(S=2, B=300, L=6000, TT=8)
    fill_hot(st, 1, list(range(0, 600, 2))[:300], [int(v) for v in torch.randint(0, 5, (300,), generator=g)])
    host, dev = _rows(st, 2, 5, 5)
    pair, got, ws = Pair(st), dev.clone().to(DEV), PlanWorkspace(DEV)
    want = _fused_step(pair, torch.randint(-1, 5000, (2, 2, 1100), generator=g), [1, 0], 10, host, dev, got, ws)
    assert want.counters.host > 64  # more than one chunk of rows a request
    sel = torch.stack([torch.randperm(5000, generator=g)[:700] for _ in range(2)])[:, None]
    _fused_step(pair, sel, [0, 1], 11, host, dev, got, ws, distinct=True)


@pytest.mark.parametrize("width", [130, 300, 520])
def test_rows_of_several_column_blocks_copy_whole(width):
    """Rows of two, three and five 64-unit column blocks (gather.copy_row_block loads up to four
    before storing them): the fused copy lands every planned row whole, in both layers."""
    g = torch.Generator().manual_seed(width)
    st = make_state(S=2, B=24, L=200, TT=4)
    fill_hot(st, 0, list(range(0, 48, 2)), [int(v) for v in torch.randint(0, 5, (24,), generator=g)])
    host, dev = _rows(st, 2, width, width)
    pair, got = Pair(st), dev.clone().to(DEV)
    sel = torch.stack([torch.randperm(190, generator=g)[:40] for _ in range(2)])[:, None]
    want = _fused_step(pair, sel, [0, 1], 10, host, dev, got)
    assert want.counters.host > 24  # more rows than one P6 chunk's worth of the smallest blocks


def test_all_direct_and_empty_calls_copy_nothing():
    """A request whose rows all resolve directly exits before P6; an empty batch launches nothing."""
    st = make_state(S=2, B=4, L=32, TT=8, direct=True)
    st.direct_loc[0] = torch.where(torch.arange(32) < 24, 100 + torch.arange(32), -1)
    host, dev = _rows(st, 1, 3, 1)
    dev = torch.full((20, 1, 8, 3), -1.0)
    pair, got = Pair(st), dev.clone().to(DEV)
    sel = torch.tensor([[[1, 5, 30, -1]], [[2, 3, 4, 29]]])
    _fused_step(pair, sel, [0, 1], 3, host, dev, got)
    empty = plan_triton(torch.zeros((0, 1, 4), dtype=torch.int64, device=DEV), torch.zeros(0, dtype=torch.int64,
                        device=DEV), pair.dev, 4, copy=(host, got))
    assert empty.copied and empty.copy_src.numel() == 0


def test_a_fused_plan_says_it_copied():
    st = make_state(S=1, B=4)
    host, dev = _rows(st, 1, 2, 0)
    src = host.pin_memory() if DEV == "cuda" else host  # host rows are read zero-copy on CUDA
    sel = torch.tensor([[[1, 2]]], device=DEV)
    slots = torch.tensor([0], device=DEV)
    assert plan_triton(sel, slots, clone_state(st, DEV), 1, copy=(src, dev.to(DEV))).copied
    assert not plan_triton(sel, slots, clone_state(st, DEV), 1).copied


def test_mismatched_copy_targets_are_refused():
    st = make_state(S=1, B=4)
    sel = torch.tensor([[[1, 2]]], device=DEV)
    with pytest.raises(ValueError, match="dtype and width"):
        plan_triton(sel, torch.tensor([0], device=DEV), st, 1, copy=(torch.zeros(4, 4, 3), torch.zeros(4, 8, 2)))


def test_the_engine_setting_reaches_the_store():
    from dhisparse.engine.config import ConfigValueError, EngineConfig

    assert EngineConfig(preset="hisparse").store_settings().resolver_copy == "separate"
    assert EngineConfig(preset="hisparse", resolver_copy="fused").store_settings().resolver_copy == "fused"
    with pytest.raises(ConfigValueError, match="resolver_copy"):
        EngineConfig(resolver_copy="both")
