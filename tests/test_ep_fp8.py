"""Expert parallelism over block-scaled FP8 experts (glm5-faithful, issue 32's scaling run): an EP
rank built by `build_faithful(ep=(rank, world))` holds exactly its block of the same seeded weights
(FP8 values and scale blocks), everything else bitwise the whole model's; `EPMoE` over
`Fp8Experts` gives the FP8 MoE's output (to rounding: the FP8 path is not batch-invariant,
layers/ep_moe.py); and two gloo processes, each with its own rows and half the experts, get what one process's whole
FP8 MoE gives for those rows. CPU (the FP8 GEMMs' reference path); NOT yet run on CUDA."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from dhisparse.core.parallel import ParallelConfig, init_rank, leave
from dhisparse.engine.rank_spawn import free_addr
from dhisparse.layers.ep_moe import EPMoE
from dhisparse.layers.fp8_linear import Fp8Experts
from dhisparse.layers.moe import MoE
from dhisparse.models.faithful import SMALL_OVERRIDES, build_faithful

SMALL = SMALL_OVERRIDES  # the small geometry: 6 routed experts, top 2; layers 3+ are MoE
BUFFERS = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")


def small(ep=None):
    return build_faithful(num_layers=5, overrides=SMALL, dtype=torch.float32, ep=ep).model


@pytest.fixture()
def world_of_one():
    init_rank(ParallelConfig(dp_size=1, timeout_s=20), 0, free_addr())
    yield
    leave()


def test_an_ep_rank_holds_its_block_of_the_same_weights():
    full = small()
    full_state = full.state_dict()
    for rank in range(2):
        part = small(ep=(rank, 2))
        moes = [layer.mlp for layer in part.model.layers if isinstance(layer.mlp, EPMoE)]
        assert len(moes) == 2 and all(isinstance(m.experts, Fp8Experts) and m.n_local == 3 for m in moes)
        for name, t in part.state_dict().items():
            want = full_state[name]
            if name.rsplit(".", 1)[-1] in BUFFERS and ".experts." in name:
                want = want[3 * rank: 3 * rank + 3]
            assert t.dtype == want.dtype and torch.equal(t, want), name
        assert part.state_dict().keys() == full_state.keys()


def test_fp8_epmoe_equals_the_fp8_moe_to_rounding(world_of_one):
    moe = small().model.layers[3].mlp
    assert isinstance(moe, MoE) and isinstance(moe.experts, Fp8Experts)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = moe(x)
        ep = EPMoE(small().model.layers[3].mlp, 0, 1)
        out = ep(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        routing = ep.gate(x)
        routed = ep.routed(x, routing)
        for i in (0, 11, 36):  # alone or in the launch: the same up to rounding (not bitwise on the FP8 path)
            alone = ep.routed(x[i: i + 1], type(routing)(routing.experts[i: i + 1], routing.weights[i: i + 1]))
            torch.testing.assert_close(alone[0], routed[i], rtol=1e-5, atol=1e-6)
        assert ep(x[:0]).shape == (0, 256)  # an idle rank's pass


def _two_ranks(rank: int, addr: str, out) -> None:
    """Spawned: rank r holds experts [3r, 3r + 3) of layer 3 and its own 5 + 4r rows; its EPMoE
    output must match the whole FP8 MoE's for those rows (the exchange carries the other rank's
    experts' work); rank 0 reports both ranks' results."""
    torch.manual_seed(0)
    full = small().model.layers[3].mlp
    ep = small(ep=(rank, 2)).model.layers[3].mlp  # built sharded: an EPMoE of rank r of 2
    init_rank(ParallelConfig(dp_size=2, timeout_s=30), rank, addr)
    try:
        x = torch.randn(5 + 4 * rank, 256, generator=torch.Generator().manual_seed(10 + rank))
        with torch.inference_mode():
            got, want = ep(x), full(x)
        ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5) and bool((got != 0).any())
        import torch.distributed as dist

        oks = [None, None]
        dist.all_gather_object(oks, ok)
        if rank == 0:
            out.put(oks)
    finally:
        leave()


def test_two_ranks_with_half_the_fp8_experts_each_give_the_whole_moes_output():
    ctx, addr = mp.get_context("spawn"), free_addr()
    q = ctx.Queue()
    procs = [ctx.Process(target=_two_ranks, args=(r, addr, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert q.get(timeout=120) == [True, True]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
