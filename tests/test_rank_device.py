"""A rank's CUDA device is made current before its engine is built (engine/rank_spawn.bind_device),
in both world starters, and the oracle drafter's reference reaches a rank's engine through the
hook's module (`hook_reference`). CPU: torch.cuda is faked, the engine stubbed (what is checked is
the order of the calls, which on a GPU decides the device of every stream, graph and Triton launch)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dhisparse.core.parallel import ParallelConfig
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.rank_spawn import bind_device, hook_reference


@pytest.fixture()
def calls(monkeypatch):
    seen: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", str(d))))
    return seen


def stub_engine(seen: list):
    class Stub:
        def __init__(self, cfg, loaded=None, oracle_reference=None) -> None:
            seen.append(("engine", cfg.device, oracle_reference))
            self.config, self.lockstep = cfg, None

    return Stub


def test_bind_device_sets_cuda_devices_only(calls):
    bind_device("cpu")
    bind_device("cuda:1")
    assert calls == [("set_device", "cuda:1")]


def test_a_dp_rank_binds_its_device_before_its_engine(calls, monkeypatch):
    import dhisparse.engine.launch as launch

    monkeypatch.setattr(launch, "Engine", stub_engine(calls))
    launch.rank_engine(EngineConfig(model="tiny", device="cuda", dp_size=2), ParallelConfig(dp_size=2), 1)
    assert calls == [("set_device", "cuda:1"), ("engine", "cuda:1", None)]


def test_a_disaggregated_rank_binds_its_device_before_its_engine(calls, monkeypatch):
    import dhisparse.engine.disagg_launch as dl

    monkeypatch.setattr(dl, "Engine", stub_engine(calls))
    cfg = EngineConfig(model="tiny", device="cuda", disaggregation_prefill_size=1, disaggregation_decode_size=1)
    dl.rank_engine(cfg, cfg.disagg_layout(), 1)
    assert calls == [("set_device", "cuda:1"), ("engine", "cuda:1", None)]


def test_the_oracle_reference_comes_from_the_hooks_module(calls, monkeypatch):
    import dhisparse.engine.launch as launch

    mod = types.ModuleType("fake_oracle_hook")
    mod.oracle_reference = lambda cfg: {(1, 2): [3]}
    mod.hook = lambda engine, rank: calls.append(("hook", rank))
    monkeypatch.setitem(sys.modules, "fake_oracle_hook", mod)
    oracle = EngineConfig(model="tiny", preset="adaptive+spec", speculative_algorithm="oracle")
    assert hook_reference("fake_oracle_hook:hook", oracle) == {(1, 2): [3]}
    assert hook_reference(None, oracle) is None
    assert hook_reference("fake_oracle_hook:hook", EngineConfig(model="tiny", preset="adaptive+spec")) is None  # dflash
    bare = types.ModuleType("bare_hook")
    monkeypatch.setitem(sys.modules, "bare_hook", bare)
    with pytest.raises(ValueError, match="oracle_reference"):
        hook_reference("bare_hook:hook", oracle)
    monkeypatch.setattr(launch, "Engine", stub_engine(calls))
    cfg = EngineConfig(model="tiny", device="cuda", dp_size=2, preset="adaptive+spec", speculative_algorithm="oracle")
    launch.rank_engine(cfg, ParallelConfig(dp_size=2), 1, "fake_oracle_hook:hook")
    assert calls == [("set_device", "cuda:1"), ("engine", "cuda:1", {(1, 2): [3]}), ("hook", 1)]
