"""Sparse-MLA attention with the value columns split between two programs (plan.value_splits 2,
kernels/sparse_mla.py `_attend_block_vs`): each program scores every column of its rows and
accumulates half of them. Checked against the plain-PyTorch reference on odd, ragged and empty
shapes, plain and FP8 rows, with and without the row split, and for batch invariance."""

from __future__ import annotations

import pytest
import torch

from dhisparse.core.kvformat import KVFormats
from dhisparse.core.rows import SPACE
from dhisparse.kernels import sparse_mla as sm
from dhisparse.kernels.sparse_mla_ref import sparse_mla_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T, H, C, R, k, n_rows, seed=0, drop=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, C, generator=g).to(DEV)
    qp = torch.randn(T, H, R, generator=g).to(DEV)
    loc = torch.randint(0, n_rows, (T, k), generator=g)
    loc[torch.rand(T, k, generator=g) < drop] = -1
    if T > 1:
        loc[1, k // 2 :] = -1  # a ragged token
    if T > 2:
        loc[2] = -1  # a padding token: zeros
    return q, qp, loc.to(DEV)


def _plan(H, C, R, split, vs=2):
    return sm.plan_sparse_mla(H, C, R, split_rows=split, dtype=torch.float32, value_splits=vs)


@pytest.mark.parametrize("T,H,C,R,k,per,split", [(3, 5, 32, 8, 37, 4, 0), (4, 3, 64, 6, 70, 3, 16), (1, 17, 32, 8, 5, 1, 0),
                                                 (5, 16, 128, 16, 130, 16, 32), (0, 4, 32, 8, 9, 4, 0),
                                                 (3, 4, 32, 8, 0, 4, 0)])
def test_value_split_matches_the_reference_on_plain_rows(T, H, C, R, k, per, split):
    rows = torch.randn(9, per, C + R).to(DEV)
    q, qp, loc = _case(T, H, C, R, k, 9 * per)
    got = sm.run_sparse_mla(_plan(H, C, R, split), q, qp, rows, loc, 0.37)
    want = sparse_mla_reference(q, qp, rows, loc, 0.37)
    assert got.shape == want.shape == (T, H, C)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if T > 2:
        assert got[2].abs().max() == 0
    unsplit = sm.run_sparse_mla(_plan(H, C, R, split, vs=1), q, qp, rows, loc, 0.37)
    torch.testing.assert_close(got, unsplit, rtol=1e-5, atol=1e-5)


def test_value_split_reads_two_row_spaces():
    C, R, P, per = 64, 8, 5, 4
    pages, stage = torch.randn(P, per, C + R).to(DEV), torch.randn(1, 23, C + R).to(DEV)
    q, qp, loc = _case(4, 5, C, R, 40, P * per, drop=0.2)
    g = torch.Generator().manual_seed(3)
    staged = (torch.rand(loc.shape, generator=g) < 0.5).to(DEV) & (loc >= 0)
    loc = torch.where(staged, SPACE + torch.randint(0, 23, loc.shape, generator=g).to(DEV), loc)
    for split in (0, 16):
        got = sm.run_sparse_mla(_plan(5, C, R, split), q, qp, (pages, stage), loc, 0.2)
        torch.testing.assert_close(got, sparse_mla_reference(q, qp, (pages, stage), loc, 0.2), rtol=1e-5, atol=1e-5)


def _fp8_case(C, R, T, H, k, tile, P=6, per=16):
    g = torch.Generator().manual_seed(1)
    fmt = KVFormats.mla("fp8_e4m3", C + R, R, tile, torch.float32).latent
    rows = fmt.encode(torch.randn(P * per, C + R, generator=g)).view(P, per, fmt.width).to(DEV)
    q, qp, loc = _case(T, H, C, R, k, P * per)
    return fmt, rows, q, qp, loc


@pytest.mark.parametrize("mode", ["gather", "reshape", "select", "fold"])
@pytest.mark.parametrize("C,tile,split", [(32, 16, 0), (32, 16, 16), (512, 128, 32), (32, 32, 0)])
def test_value_split_reads_fp8_rows_like_the_reference(mode, C, tile, split, monkeypatch):
    """Every scale path (a half reads its own tiles' scales; fold and a tile that straddles the halves
    fall back to select / per-value scales), GLM's 512 values in tiles of 128 included."""
    monkeypatch.setenv("DHISPARSE_FP8_SCALES", mode)
    R = 64 if C == 512 else 8
    fmt, rows, q, qp, loc = _fp8_case(C, R, 3, 16 if C == 512 else 5, 40, tile)
    got = sm.run_sparse_mla(_plan(q.shape[1], C, R, split), q, qp, rows, loc, 0.05, fmt)
    want = sparse_mla_reference(q, qp, rows, loc, 0.05, fmt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_value_split_is_batch_invariant():
    """A token's output is bitwise the same alone, in a decode-sized pass and in a longer one."""
    C, R, k = 64, 8, 96
    rows = torch.randn(8, 16, C + R).to(DEV)
    q, qp, loc = _case(12, 6, C, R, k, 128, seed=5)
    for split in (0, 32):
        plan = _plan(6, C, R, split)
        full = sm.run_sparse_mla(plan, q, qp, rows, loc, 0.3)
        assert torch.equal(sm.run_sparse_mla(plan, q[::3], qp[::3], rows, loc[::3], 0.3), full[::3])
        for t in (0, 1, 11):
            assert torch.equal(sm.run_sparse_mla(plan, q[t : t + 1], qp[t : t + 1], rows, loc[t : t + 1], 0.3)[0], full[t])


@pytest.mark.skipif(DEV != "cuda", reason="the wide tile with bf16 queries is the GPU's")
def test_value_split_on_the_wide_tile_in_bf16():
    """glm5-faithful's shape: 64 heads, C 512, FP8 rows, k 2,048 over 512-row splits, bf16 queries."""
    fmt, rows, q, qp, loc = _fp8_case(512, 64, 9, 64, 2048, 128, P=64, per=64)
    q, qp = q.bfloat16(), qp.bfloat16()
    plan = sm.plan_sparse_mla(64, 512, 64, value_splits=2)
    assert plan.wide and plan.value_splits == 2
    got = sm.run_sparse_mla(plan, q, qp, rows, loc, 0.05, fmt)
    torch.testing.assert_close(got.float(), sparse_mla_reference(q, qp, rows, loc, 0.05, fmt).float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(sm.run_sparse_mla(plan, q[:1], qp[:1], rows, loc[:1], 0.05, fmt)[0], got[0])


def test_value_splits_are_checked():
    with pytest.raises(ValueError, match="value_splits"):
        sm.plan_sparse_mla(4, 32, 8, value_splits=3)
    with pytest.raises(ValueError, match="value_splits"):
        sm.plan_sparse_mla(4, 48, 8, value_splits=2)  # C not a power of two
    assert sm.plan_sparse_mla(64, 512, 64).value_splits == 1  # off unless asked for
