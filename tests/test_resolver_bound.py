"""plan_triton's bound launches (kernels/resolver.py `_launch`, kernels/launch.py `BoundLaunch`): a repeat
call with a workspace hands the compiled launchers exactly what the unbound path would, and the binding
is dropped whenever what it holds changes.

On the CPU the compiled launchers are stand-ins that record their arguments (the held path is CUDA-only);
the CUDA exactness runs cover the real launches (the resolver, hierarchy and engine tests call the plan
with a store's workspace many times).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton.runtime.jit import JITFunction  # noqa: E402

import dhisparse.kernels.launch as L  # noqa: E402
import dhisparse.kernels.resolver as kr  # noqa: E402
import dhisparse.kernels.resolver_args as ra  # noqa: E402
from dhisparse.kernels.gather import row_copy  # noqa: E402
from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import ResolverState, with_hot_entry  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in launchers: CPU only")


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def launch_metadata(self, *a):
        return None

    def run(self, *a):
        self.calls.append((self.name, a[:4], a[9:]))


@pytest.fixture
def calls(monkeypatch):
    """_PLAN and _PRE on the held path with recording stand-in compiled kernels; returns the record."""
    monkeypatch.setattr(L, "_interpreted", lambda: False)
    monkeypatch.setattr(L, "_raw_stream", lambda dev: 7)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rec = []
    for attr, kernel in (("_PLAN", kr.resolve_plan_kernel), ("_PRE", kr.direct_pre_kernel)):
        names = [p for p in kernel.fn.__code__.co_varnames[: kernel.fn.__code__.co_argcount]]
        launch = L.CompiledLaunch(JITFunction(kernel.fn, do_not_specialize=names, do_not_specialize_on_alignment=names))
        compiled = _Compiled(attr, rec)
        launch.kernel = type("J", (), {"__getitem__": lambda self, g, c=compiled: lambda *a, **k: c,
                                       "fn": kernel.fn})()
        monkeypatch.setattr(kr, attr, launch)
    return rec


def _state(N=3, B=8, L=64, ps=4, direct=False, index=False) -> ResolverState:
    g = torch.Generator().manual_seed(N * 100 + B)
    i64 = dict(dtype=torch.int64)
    st = ResolverState(torch.full((N, B), -1, **i64), torch.full((N, B), -1, **i64), torch.arange(N * B).view(N, B),
                       torch.full((N,), L, **i64), N * B + torch.arange(N * 2 * ps).view(N, 2 * ps),
                       torch.stack([torch.randperm(L // ps + 2, generator=g) for _ in range(N)]), ps,
                       torch.arange(L).repeat(N, 1) if direct else None)
    return with_hot_entry(st) if index else st


def _sel(N=3, k=6, L=64, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(N)]).view(N, 1, k)


class _FixedOutputs:
    """ra.outputs returning the same tensors until `swap` (so two calls' output addresses compare)."""

    def __init__(self):
        self.real, self.held = ra.outputs, None

    def __call__(self, *a):
        if self.held is None:
            self.held = self.real(*a)
        return self.held

    def swap(self):
        self.held = None


@pytest.mark.parametrize("direct,index,copy", [(False, False, False), (True, False, False), (False, True, True),
                                               (True, True, True)])
def test_a_bound_call_hands_the_launchers_what_the_unbound_path_would(calls, monkeypatch, direct, index, copy):
    """Call 1 compiles and binds; call 2 (new sel, slots, now, tail starts and outputs) goes through the
    binding; call 3 repeats call 2 with the bindings dropped. Calls 2 and 3 must launch identically,
    and call 2 must differ from call 1 where the per-call tensors changed (they are live)."""
    outs = _FixedOutputs()
    monkeypatch.setattr(ra, "outputs", outs)
    st, ws = _state(direct=direct, index=index), PlanWorkspace("cpu")
    rc = row_copy(torch.zeros(20, 4, 8), torch.zeros(12, 4, 8)) if copy else None
    run = lambda sel, slots, now: plan_triton(sel, slots, st, now, defer=True, workspace=ws, distinct=True, copy=rc)
    run(_sel(seed=1), torch.arange(3), torch.tensor([5]))
    assert len(ws.launches) == 1 and not calls  # the first call went through the JIT
    outs.swap()
    st.tail_start = st.tail_start.clone()
    sel, slots, now = _sel(seed=2), torch.tensor([2, 0, 1]), torch.tensor([6])
    run(sel, slots, now)
    bound = list(calls)
    ws.launches.clear()
    run(sel, slots, now)
    unbound = calls[len(bound):]
    assert [c[0] for c in bound] == (["_PRE", "_PLAN"] if direct else ["_PLAN"])
    assert bound == unbound
    vals = bound[-1][2]
    loc, src, dst, cnt, copy_n = outs.held
    for i, t in zip(kr._PLAN_LIVE, (sel, slots, st.tail_start, now, loc, src, dst, copy_n, cnt)):
        assert vals[i] == t.data_ptr(), i


def test_the_binding_follows_the_state_the_workspace_and_the_copy_target(calls):
    """A replaced host table, a grown workspace, another copy target or a pair given as tensors each
    launch with what they hold now (the unbound path's values), never the bound ones."""
    st, ws = _state(), PlanWorkspace("cpu")
    sel, slots, now = _sel(), torch.arange(3), torch.tensor([5])
    run = lambda **kw: plan_triton(sel, slots, st, now, defer=True, workspace=ws, distinct=True, **kw)
    run()
    run()
    st.host_table = st.host_table.clone()
    run()
    assert calls[-1][2][14] == st.host_table.data_ptr()
    big = _state(N=5)  # more requests: the workspace's buffers grow
    plan_triton(_sel(N=5), torch.arange(5), big, now, defer=True, workspace=ws, distinct=True)
    run()
    scr64 = ws.scratch(3, 8, 8, ra.state_args(st).lcap, torch.int16, 1, False)[0]
    assert calls[-1][2][28] == scr64.data_ptr()
    one, two = row_copy(torch.zeros(20, 4, 8), torch.zeros(12, 4, 8)), row_copy(torch.zeros(20, 4, 8), torch.zeros(12, 4, 8))
    run(copy=one)
    run(copy=two)
    assert calls[-1][2][33] == two.src.data_ptr()
    n = len(ws.launches)
    run(copy=(torch.zeros(20, 4, 8), torch.zeros(12, 4, 8)))
    assert len(ws.launches) == n  # a tensor pair is a new target each call: not bound
