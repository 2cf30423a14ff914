"""The MoE's two expert paths (dense small-batch, grouped loop) compute the same function."""

from __future__ import annotations

import pytest
import torch

from dhisparse.layers.moe import MoE
from dhisparse.models.tiny import tiny_config


@pytest.mark.parametrize("T", [0, 1, 3, 17])
def test_dense_and_grouped_expert_paths_agree(T):
    torch.manual_seed(T)
    moe = MoE(tiny_config())
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    moe.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(T, moe.experts.down_proj.shape[1])
    routing = moe.gate(x)
    dense = moe.experts._dense(x, routing)
    grouped = moe.experts._grouped(x, routing)
    assert dense.shape == grouped.shape == x.shape
    torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-5)
    assert torch.equal(moe.experts(x, routing), dense)  # small batches take the dense path
