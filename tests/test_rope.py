"""`rope_fused` (two gathers + mul + addcmul with per-pass tables) equals the reference rotations."""

from __future__ import annotations

import pytest
import torch

from dhisparse.layers.rope import RopeTables, rope_fused, rope_half_split, rope_interleaved


@pytest.mark.parametrize("T,heads,r", [(0, 3, 8), (1, 1, 2), (5, 4, 64), (7, None, 16)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_rope_matches_reference(T, heads, r, interleaved):
    g = torch.Generator().manual_seed(T * 100 + r)
    shape = (T, heads, r) if heads else (T, r)
    x = torch.randn(shape, generator=g)
    ang = torch.rand(T, r // 2, generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    ref = (rope_interleaved if interleaved else rope_half_split)(x, cos, sin)
    got = rope_fused(x, RopeTables.build(cos, sin), interleaved)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    bf = rope_fused(x.bfloat16(), RopeTables.build(cos.bfloat16(), sin.bfloat16()), interleaved)
    torch.testing.assert_close(bf.float(), ref, rtol=2e-2, atol=2e-2)
