"""The DFlash drafter's grouped-query attention (`grouped_attention`) against the per-head form it
replaced: K/V repeated to every query head (`repeat_interleave`: query head h reads K/V head
h // (Hq / kvh)), upcast, masked softmax. Odd shapes, an empty context, a single K/V head, no
grouping, queries that see nothing; and a wrong head pairing must fail the same comparison."""

from __future__ import annotations

import pytest
import torch

from dhisparse.spec.dflash_model import attention_mask, grouped_attention, per_head_attention


def case(n, b, length, hq, kvh, d, dtype=torch.float32, seed=0, window=None, causal=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, ck, cv, kb, vb = r(n, b, hq, d), r(n, length, kvh, d), r(n, length, kvh, d), r(n, b, kvh, d), r(n, b, kvh, d)
    q_pos = length + torch.arange(b)[None].expand(n, -1)
    k_pos = torch.arange(length + b)[None].expand(n, -1)
    valid = torch.rand(n, length + b, generator=g) > 0.2
    valid[:, length:] = True
    return q, ck, cv, kb, vb, attention_mask(q_pos, k_pos, valid, window, causal)


SHAPES = [  # n, b, L, Hq, kvh, d
    (1, 1, 0, 1, 1, 2), (3, 5, 7, 6, 2, 6), (2, 4, 13, 12, 4, 8), (4, 3, 9, 5, 5, 4), (2, 7, 1, 8, 1, 16),
    (1, 8, 33, 48, 4, 10),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", [(None, False), (3, True), (4, False)])
def test_grouped_equals_per_head(shape, mask):
    args = case(*shape, window=mask[0], causal=mask[1])
    got, want = grouped_attention(*args), per_head_attention(*args)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_are_upcast_like_the_per_head_form():
    args = case(3, 4, 11, 12, 3, 16, dtype=torch.bfloat16, seed=3)
    torch.testing.assert_close(grouped_attention(*args), per_head_attention(*args), rtol=1e-5, atol=1e-6)


def test_a_query_that_sees_nothing_gets_zero():
    q, ck, cv, kb, vb, visible = case(2, 3, 5, 4, 2, 4)
    visible[1, 2] = False
    out = grouped_attention(q, ck, cv, kb, vb, visible)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2])) and torch.isfinite(out).all()


def test_a_wrong_head_pairing_fails_the_comparison():
    """Mutation check: pairing query head h with K/V head h % kvh (`repeat`, not `repeat_interleave`)
    is caught by the comparison above. That pairing is the reference run with query head h moved to
    slot (h % kvh) * rep + h // kvh, and moved back."""
    q, *rest = case(2, 4, 9, 6, 2, 8, seed=7)
    hq, kvh = q.shape[2], rest[0].shape[2]
    slot = torch.tensor([(h % kvh) * (hq // kvh) + h // kvh for h in range(hq)])
    moved = torch.empty_like(q)
    moved[:, :, slot] = q
    wrong = per_head_attention(moved, *rest)[:, :, slot]
    assert not torch.allclose(grouped_attention(q, *rest), wrong, rtol=1e-5, atol=1e-6)
