"""Helpers of the parallel tests: hooks a spawned rank runs on its engine (`engine/launch.py`
on_engine="dist_hooks:NAME"), the single-process references and greedy runs over a built world,
and the CI-sized preset parametrization of the world tests (`world_presets`).

CI must finish inside its budget on 2 CPU cores. A multi-process test (a DP / TP / EP or
prefill/decode world of spawned ranks, ~10-20 s a case on CI's machine) runs two presets in CI:
`hisparse` (the hierarchy under pressure: resolver, hot cache, host copies) and `adaptive+spec`
(residency, reclaim and speculation). The other presets are marked `slow`: `python -m pytest -m
slow` (or `-m ""` for everything) runs them. The worlds' ranks run on CPU (the tests pin
device="cpu") even on the GPU machine, so the slow presets add no CUDA coverage to the exactness
runs, which keep the default selection. References are computed per preset on first use
(`ByPreset`), so a CI run builds only the ones its presets compare against."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from kv_check import checked


PRESETS = ("resident", "hisparse", "adaptive", "adaptive+spec")
CI_PRESETS = ("hisparse", "adaptive+spec")


def world_presets(presets=PRESETS, ci=CI_PRESETS) -> list:
    """`presets` as pytest params, those outside `ci` marked slow (module docstring)."""
    return [p if p in ci else pytest.param(p, marks=pytest.mark.slow) for p in presets]


class ByPreset(dict):
    """preset -> make(preset), computed on first access and kept."""

    def __init__(self, make: Callable[[str], object]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, preset: str):
        self[preset] = value = self.make(preset)
        return value


def one_process_tokens(prompts, params) -> ByPreset:
    """preset -> the single-process engine's token ids for `prompts` (fp64, the tests' small pools)."""
    from dhisparse import LLM

    return ByPreset(lambda p: [o.token_ids for o in LLM("tiny", preset=p, dtype="float64", device="cpu", kv_pool_bytes=8 << 20,
                                                       host_pool_bytes=16 << 20).generate(prompts, params)])


def generate_on(engine, prompts, params) -> list[list[int]]:
    """`LLM.generate`'s token ids over an already built engine or Coordinator."""
    from dhisparse import LLM

    llm = LLM.__new__(LLM)
    llm.engine = engine
    return [o.token_ids for o in llm.generate(prompts, params)]


def row_checker(engine, rank: int) -> None:
    """Every location the rank's store returns is checked against a dense mirror (I2)."""
    checked(SimpleNamespace(engine=engine))


def stale_rows_on_rank1(engine, rank: int) -> None:
    """A breakage for the checker: rank 1's store points each selected row at its neighbour's
    location; the row checker on that rank must catch it (rank 0 then sees the rank lost)."""
    if rank == 1:
        orig = engine.store.context

        def context(batch, reqs):
            ctx = orig(batch, reqs)
            inner = ctx.locate

            def locate(layer, selection):
                rows, loc = inner(layer, selection)
                return rows, torch.where(loc >= 0, torch.roll(loc, 1, dims=-1).clamp(min=0), loc)

            ctx.locate = locate
            return ctx

        engine.store.context = context
    row_checker(engine, rank)


def swap_experts_on_rank1(engine, rank: int) -> None:
    """A breakage for EP parity: rank 1's expert block in reverse order (every token routed to one
    of its experts gets another's output); the tokens must differ from one process's."""
    row_checker(engine, rank)
    if rank == 1:
        for layer in engine.model.model.layers:
            ex = getattr(layer.mlp, "experts", None)
            if ex is not None and hasattr(layer.mlp, "n_local"):
                ex.gate_up_proj.data = ex.gate_up_proj.data.flip(0).clone()
                ex.down_proj.data = ex.down_proj.data.flip(0).clone()


def no_idle_pass_on_rank1(engine, rank: int) -> None:
    """A breakage for the lock-step: rank 1 skips the idle pass (its lockstep reports no work and
    joins no exchange) so the MoE all-to-alls lack a rank; rank 0 must see RankLost, not hang."""
    if rank == 1:
        inner = engine.lockstep
        engine.lockstep = lambda has: inner(has) and has


def ep_invariance(rank: int, world: int, addr: str, out) -> None:
    """Spawned: rank 0's MoE output for its 3 tokens (the same rows each time), alone and with 1..40 of rank 1's rows in the
    same exchange; put on `out` whether every result is bitwise the first."""
    import torch.distributed as dist

    from dhisparse.models.tiny import tiny_config
    from dhisparse.core.parallel import ParallelConfig, init_rank, leave
    from dhisparse.layers.ep_moe import EPMoE
    from dhisparse.layers.moe import MoE

    torch.manual_seed(0)
    cfg = tiny_config()
    moe = MoE(cfg).double()
    for p in moe.parameters():
        p.data.normal_(0, 0.05)
    ep = EPMoE(moe, rank, world)
    init_rank(ParallelConfig(dp_size=world, timeout_s=20), rank, addr)
    try:
        gen = torch.Generator().manual_seed(1)
        mine = torch.randn(3, cfg.hidden_size, generator=gen, dtype=torch.float64)
        results = []
        with torch.inference_mode():
            for n in (0, 1, 7, 16, 17, 40):
                x = mine if rank == 0 else torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64)
                results.append(ep(x))
        dist.barrier()
        if rank == 0:
            out.put(all(torch.equal(r, results[0]) for r in results) and results[0].abs().sum().item() > 0)
    finally:
        leave()


def same_routing(engine, rank: int) -> None:
    """Tensor parallelism: every MoE router's choice (experts and weights [T, k]) is all-gathered
    and must be the same on every rank (the router is replicated over replicated rows); with the
    row checker (I2) on every rank."""
    import torch.distributed as dist

    from dhisparse.layers.moe import MoE

    row_checker(engine, rank)
    gates = [m.gate for m in engine.model.model.modules() if isinstance(m, MoE)]
    assert gates, "no MoE router to check"
    for gate in gates:
        inner = gate.forward

        def forward(x, inner=inner):
            routing = inner(x)
            for t in (routing.experts, routing.weights.double()):
                parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, t.contiguous())
                assert all(torch.equal(p, parts[0]) for p in parts), f"rank {rank}: the ranks routed differently"
            return routing

        gate.forward = forward


def drop_request_on_rank1(engine, rank: int) -> None:
    """A breakage for the TP batch check: rank 1 silently drops the second request it is given,
    so its scheduler's batch differs from rank 0's; the ranks must fail with RankLost at rank 0,
    not hang nor report rank 0's tokens as if nothing happened."""
    row_checker(engine, rank)
    if rank == 1:
        inner, seen = engine.add_request, []

        def add_request(ids, params=None, request_id=None, **kw):
            seen.append(request_id)
            return request_id if len(seen) == 2 else inner(ids, params, request_id=request_id, **kw)

        engine.add_request = add_request


class _Patcher:
    """`monkeypatch.setattr` outside pytest (a spawned rank patches its own process for good)."""

    setattr = staticmethod(setattr)


def v4_source_check(engine, rank: int) -> None:
    """DeepSeek-V4's row checker on every rank: each located / reused CSA row of the hierarchical
    presets checked against a shadow copy of every emitted row (I2; v4_engine_util.SourceCheck).
    Under `resident` nothing is located through a V4HierPass: the check is vacuous there. The
    check is kept as `engine.source_check` (its counters: located / reused rows)."""
    from v4_engine_util import SourceCheck

    engine.source_check = SourceCheck().install(_Patcher())


def v4_swap_experts_on_rank1(engine, rank: int) -> None:
    """A breakage for V4 EP parity: rank 1's expert block in reverse order in every EPMoE layer."""
    v4_source_check(engine, rank)
    if rank == 1:
        for layer in engine.model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.data = ex.gate_up_proj.data.flip(0).clone()
            ex.down_proj.data = ex.down_proj.data.flip(0).clone()


def v4_positions_as_ids_on_rank1(engine, rank: int) -> None:
    """A breakage for V4 hash routing: on rank 1 (the owner of its own DP requests) every
    hash-routed layer's MoE is given the tokens' positions instead of their ids."""
    v4_source_check(engine, rank)
    if rank == 1:
        vocab = engine.model.config.vocab_size
        for layer in engine.model.model.layers:
            if getattr(layer.mlp.gate, "hashed", False):
                _route_by_positions(layer, vocab)


def _route_by_positions(layer, vocab: int) -> None:
    inner, mlp = layer.forward, layer.mlp

    def forward(streams, ropes, batch, ctx):
        real = mlp.forward
        mlp.forward = lambda x, ids: real(x, batch.positions.clamp(0, vocab - 1))
        try:
            return inner(streams, ropes, batch, ctx)
        finally:
            del mlp.forward

    layer.forward = forward
