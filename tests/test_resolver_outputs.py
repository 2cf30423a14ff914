"""plan_triton's kept output blocks (kernels/resolver_args.py `OutBlock`, `PlanWorkspace.reuse_outputs`, an experiment
under DHISPARSE_PLAN_OUTPUT_REUSE=1): a call reuses an earlier call's outputs only when nothing holds that call's
plan or a view of it, and the plans stay exact across reuse.

Breakages tried (each fails here): reuse without the free check, a check of the views' references alone (a view
derived from a dropped plan's loc is overwritten), a check of the storages alone (a held plan is overwritten), no
capture guard, no pool bound."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as hs

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_resolver_kernel import DEV, Pair  # noqa: E402
from test_resolver_reference import make_state  # noqa: E402

import dhisparse.kernels.resolver_args as ra  # noqa: E402
from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402


def _ws(reuse=True) -> PlanWorkspace:
    ws = PlanWorkspace(DEV)
    ws.reuse_outputs = reuse
    return ws


def _sels(n, seed=0, N=2, K=2, k=3, L=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-1, L, (N, K, k), generator=g) for _ in range(n)]


def test_steps_through_reused_outputs_stay_exact():
    """Ten steps with eviction, each plan dropped before the next call: every call after the first reuses the
    first call's block (same addresses) and every plan equals the reference."""
    p, ws = Pair(make_state(S=3, B=6, L=40, TT=4)), _ws()
    ptrs = set()
    for now, sel in enumerate(_sels(10, seed=5)):
        _, got = p.step(sel, [2, 0] if now % 2 else [0, 1], now, defer=True, ws=ws)
        ptrs.add(got.loc.data_ptr())
        del got
    assert len(ptrs) == 1 and len(ws.outputs) == 1 and len(next(iter(ws.outputs.values()))) == 1


def test_int32_selections_reuse_their_separate_loc_and_match_fresh_outputs():
    """An int32 selection's loc is its own tensor beside the int64 block: both are reused, and each step equals
    the same step on fresh outputs."""
    from test_resolver_reference import clone_state

    st = make_state(S=3, B=6, L=40, TT=4)
    a, b = clone_state(st, DEV), clone_state(st, DEV)
    ws_a, ws_b, ptrs = _ws(), _ws(reuse=False), set()
    for now, sel in enumerate(_sels(8, seed=7)):
        sel = sel.to(torch.int32).to(DEV)
        slots = torch.tensor([2, 0] if now % 2 else [0, 1], device=DEV)
        got = plan_triton(sel, slots, a, now, defer=True, workspace=ws_a).materialize()
        want = plan_triton(sel, slots, b, now, defer=True, workspace=ws_b).materialize()
        assert got.loc.dtype == torch.int32 and torch.equal(got.loc, want.loc) and got.counters == want.counters
        assert torch.equal(got.copy_src, want.copy_src) and torch.equal(got.copy_dst, want.copy_dst)
        ptrs.add((got.loc.data_ptr(), got.src_pad.data_ptr()))
        del got
    assert len(ptrs) == 1


def _state():
    """make_state's small state on the tests' device (it builds on the CPU)."""
    from test_resolver_reference import clone_state

    return clone_state(make_state(S=3, B=6, L=40, TT=4), DEV)


def _plan(st, ws, sel, now):
    return plan_triton(sel.to(DEV), torch.tensor([0, 1], device=DEV), st, now, defer=True, workspace=ws)


def test_a_held_plan_or_a_view_of_one_is_never_overwritten():
    st, ws = _state(), _ws()
    a_sel, b_sel, c_sel, d_sel = _sels(4, seed=1)
    a = _plan(st, ws, a_sel, 0)
    a_loc, a_ptr = a.loc.clone(), a.loc.data_ptr()
    b = _plan(st, ws, b_sel, 1)  # a is held: a new block
    assert b.loc.data_ptr() != a.loc.data_ptr() and torch.equal(a.loc, a_loc)
    row = a.loc[1]  # a view derived from a's outputs outlives a
    row_was = row.clone()
    del a
    c = _plan(st, ws, c_sel, 2)  # a's block is not free (its storage has the view), b is held: a third block
    assert torch.equal(row, row_was) and c.loc.data_ptr() not in (row.data_ptr(), b.loc.data_ptr())
    del row, c
    d = _plan(st, ws, d_sel, 3)  # a's block is free again, and first in the pool
    assert d.loc.data_ptr() == a_ptr and len(ws.outputs[next(iter(ws.outputs))]) == 3


def test_reuse_is_off_by_default_in_a_capture_without_the_count_and_past_the_pool(monkeypatch):
    st = _state()
    sel = _sels(1, seed=2)[0]
    from dhisparse.kernels import backend

    backend.configure(backend.KernelSettings())  # the defaults, whatever the environment (the fixture restores it)
    assert not PlanWorkspace(DEV).reuse_outputs  # the experiment is opt-in
    ws = _ws(reuse=False)
    _plan(st, ws, sel, 0)
    assert not ws.outputs
    ws = _ws()
    held = [_plan(st, ws, sel, n) for n in range(ra.OUT_POOL + 2)]  # all held: a block each, the pool bounded
    assert len({h.loc.data_ptr() for h in held}) == len(held) and len(ws.outputs[next(iter(ws.outputs))]) == ra.OUT_POOL
    del held
    monkeypatch.setattr(ra, "capturing", lambda dev: True)  # a capture takes a fresh block, keeps none
    ws = _ws()
    _plan(st, ws, sel, 0)
    assert not ws.outputs
    monkeypatch.undo()
    monkeypatch.setattr(ra, "USE_COUNT", None)  # no storage count in this torch: never reused
    ws = _ws()
    first = _plan(st, ws, sel, 0).loc.data_ptr()
    assert not ws.outputs and first is not None


@pytest.mark.parametrize("preset,spec", [("hisparse", False), ("hisparse", True)])
def test_a_served_run_reuses_the_outputs_and_gives_the_reference_tokens(monkeypatch, preset, spec):
    """The engine's Triton resolver path under DHISPARSE_PLAN_OUTPUT_REUSE=1: its store keeps plan outputs, a
    decode step reuses the previous step's (the engine drops a step's plans before the next step's calls), and
    the greedy tokens equal the reference's, decoding and in verification rounds (whose shapes vary more).
    Eager (cuda_graphs="none"): on CUDA the default captures decode steps, and a capture keeps no block (the
    exactness runs with the variable set cover the graphs)."""
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.llm import LLM

    monkeypatch.setenv("DHISPARSE_PLAN_OUTPUT_REUSE", "1")
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = [[3 + (7 * i + 5 * j) % 120 for j in range(60 + 23 * i)] for i in range(3)]
    ref = {tuple(p): o.token_ids for p, o in zip(ps, LLM("tiny").generate(ps, sp))}
    extra = dict(speculative_algorithm="oracle", speculative_num_draft_tokens=4,
                 speculative_oracle_tokens_per_round=3.0) if spec else {}
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(preset=preset, resolver="triton", hot_cache_rows=16, page_size=4,
                                     kv_pool_bytes=1 << 20, max_running_requests=8, cuda_graphs="none", **extra),
                        oracle_reference=ref if spec else None)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [ref[tuple(p)] for p in ps]
    ws = llm.engine.store.plan_ws  # the GLM hierarchy's (kv/hier/hierarchy.py)
    assert ws.reuse_outputs and sum(map(len, ws.outputs.values())) > 0
    if not spec:  # decode steps repeat their shape; a step's plans are dropped before the next step's (21 calls: 18 reuse)
        assert ws.outputs_reused > 0



@settings(max_examples=60, deadline=None)
@example(ops=[("plan", 0), ("drop", 0), ("plan", 0), ("plan", 0)], wide=True)  # a reused block, held, then asked again
@example(ops=[("plan", 0), ("plan", 0), ("plan", 0)], wide=False)  # held blocks with a separate loc
@example(ops=[("plan", 0), ("view", 0), ("drop", 0), ("plan", 0)], wide=True)  # a view outlives its plan
@given(ops=hs.lists(hs.tuples(hs.sampled_from(["plan", "drop", "view", "unview"]), hs.integers(0, 7)), max_size=24),
       wide=hs.booleans())
def test_no_held_output_is_ever_written_by_a_later_call(ops, wide):
    """A state machine over `reused_outputs` (the kernel stood in by filling every output with the call's number):
    plans are made, dropped, viewed (a slice of loc kept) and unviewed in any order; every output still held --
    by a plan or by a view of one -- keeps the number of the call that made it, and a shape's pool stays bounded."""
    ws, shape, dtype = _ws(), (2, 1, 5), torch.int64 if wide else torch.int32
    plans, views, n = {}, {}, 0
    for op, i in ops:
        if op == "plan":
            n += 1
            plans[n] = ra.reused_outputs(ws, shape, 3, dtype, torch.device(DEV))
            _fill(plans[n], n)
        elif op == "drop" and plans:
            plans.pop(sorted(plans)[i % len(plans)])
        elif op == "view" and plans:
            k = sorted(plans)[i % len(plans)]
            views[k] = plans[k][0][i % 2]  # a row of loc: a view of the plan's storage
        elif op == "unview" and views:
            views.pop(sorted(views)[i % len(views)])
        _check_held(plans, views, op)  # in a function: its loop variables hold no output past the check
        assert all(len(p) <= ra.OUT_POOL for p in ws.outputs.values())


def _fill(out: tuple, n: int) -> None:
    """The kernel's stand-in: every output of call n set to n."""
    for t in out:
        t.fill_(n)


def _check_held(plans: dict, views: dict, op: str) -> None:
    for k, out in plans.items():
        assert all(bool((t == k).all()) for t in out), (op, k)
    for k, v in views.items():
        assert bool((v == k).all()), (op, k)
