"""The DFlash drafter's grouped-query attention (`grouped_attention`) against the per-head form it
replaced: K/V repeated to every query head (`repeat_interleave`: query head h reads K/V head
h // (Hq / kvh)), upcast, masked softmax. Odd shapes, an empty context, a single K/V head, no
grouping, queries that see nothing; and a wrong head pairing must fail the same comparison. 16-bit
inputs take a fused form (one scaled_dot_product_attention in their dtype), held to bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from dhisparse.spec.dflash_model import attention_mask, grouped_attention, per_head_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the 16-bit form runs the GPU's SDPA backends


def case(n, b, length, hq, kvh, d, dtype=torch.float32, seed=0, window=None, causal=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, ck, cv, kb, vb = r(n, b, hq, d), r(n, length, kvh, d), r(n, length, kvh, d), r(n, b, kvh, d), r(n, b, kvh, d)
    q_pos = length + torch.arange(b)[None].expand(n, -1)
    k_pos = torch.arange(length + b)[None].expand(n, -1)
    valid = torch.rand(n, length + b, generator=g) > 0.2
    valid[:, length:] = True
    out = q, ck, cv, kb, vb, attention_mask(q_pos, k_pos, valid, window, causal)
    return tuple(t.to(DEV) for t in out)


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


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", [(None, False), (3, True)])
def test_16_bit_inputs_take_the_fused_form_within_bf16_rounding(shape, mask):
    """bf16 inputs (the GPU drafter's) go through one fused scaled_dot_product_attention in bf16: the
    per-head fp32 form's result within bf16 rounding (the probabilities meet V in 16 bits), in bf16."""
    args = case(*shape, dtype=torch.bfloat16, seed=3, window=mask[0], causal=mask[1])
    got, want = grouped_attention(*args), per_head_attention(*args)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_fused_form_pairs_heads_and_masks_like_the_reference():
    """Mutation checks of the 16-bit form at a tolerance that bf16 rounding passes: a K/V head paired
    by `repeat` instead of `repeat_interleave`, or the mask of the wrong block row, fails it."""
    q, ck, cv, kb, vb, visible = case(2, 4, 9, 6, 2, 8, dtype=torch.bfloat16, seed=7, window=3, causal=True)
    got = grouped_attention(q, ck, cv, kb, vb, visible).float()
    assert not torch.allclose(got, repeat_paired(q, ck, cv, kb, vb, visible), rtol=2e-2, atol=2e-2)
    assert not torch.allclose(got, per_head_attention(q, ck, cv, kb, vb, visible.flip(1)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_that_sees_nothing_gets_zero(dtype):
    q, ck, cv, kb, vb, visible = case(2, 3, 5, 4, 2, 4, dtype=dtype)
    visible[1, 2] = False
    out = grouped_attention(q, ck, cv, kb, vb, visible)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2])) and torch.isfinite(out).all()


def repeat_paired(q, ctx_k, *rest):
    """The reference with query head h paired to K/V head h % kvh (`repeat`, not `repeat_interleave`):
    query head h moved to slot (h % kvh) * rep + h // kvh, run per head, and moved back."""
    hq, kvh = q.shape[2], ctx_k.shape[2]
    slot = torch.tensor([(h % kvh) * (hq // kvh) + h // kvh for h in range(hq)], device=q.device)
    moved = torch.empty_like(q)
    moved[:, :, slot] = q
    return per_head_attention(moved, ctx_k, *rest)[:, :, slot]


def test_a_wrong_head_pairing_fails_the_comparison():
    """Mutation check: pairing query head h with K/V head h % kvh (`repeat`, not `repeat_interleave`)
    is caught by the comparison above. That pairing is the reference run with query head h moved to
    slot (h % kvh) * rep + h // kvh, and moved back."""
    q, *rest = case(2, 4, 9, 6, 2, 8, seed=7)
    assert not torch.allclose(grouped_attention(q, *rest), repeat_paired(q, *rest), rtol=1e-5, atol=1e-6)


def test_the_fused_form_differentiates():
    """The 16-bit form's NaN pass is out of place: SDPA's backward keeps its output, so an in-place pass
    would fail a backward through it (a bf16 fine-tune of a drafter)."""
    q, *rest = case(2, 4, 9, 6, 2, 8, dtype=torch.bfloat16, seed=5)
    q.requires_grad_(True)
    grouped_attention(q, *rest).float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
