"""The plan's miss order (issue 33): "host" sorts a request's misses by host location before they take
victims; "selection" takes them in entry order with no sort, for distinct selections only. Kernel against
the reference bit for bit in both orders (TRITON_INTERPRET on CPU): both plan paths, scan and hot_entry
lookups, overflow (more misses than victims), the fused copy; the rule that picks an order; the errors.

Breakages tried (each fails a test here): HOSTORD ignored (the sort always runs: selection plans come back
host-sorted); the sort skipped under HOSTORD too; the reference ordering selection misses by position
(`uniq` order) instead of first entry; the kernel always compiled with HOSTORD (`resolver._calls`); the
rule's threshold compared with <= / its distinct test dropped; the engine's resolver step planning every
call in host order.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from test_resolver_fused_copy import _rows  # noqa: E402
from test_resolver_kernel import DEV, Pair, fill_hot, random_state  # noqa: E402
from test_resolver_one import _distinct_sel, distinct_steps  # noqa: E402
from test_resolver_reference import clone_state, make_state  # noqa: E402

from dhisparse import SamplingParams  # noqa: E402
from dhisparse.engine.llm import LLM  # noqa: E402
from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import (SELECTION_ORDER_ENTRIES, miss_order_for, plan_reference,  # noqa: E402
                                            run_copies)


@pytest.mark.parametrize("hot_map", [False, True], ids=["scan", "index"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=hs.integers(1, 5), k=hs.integers(1, 16), B=hs.integers(1, 24), L=hs.integers(8, 64), TT=hs.integers(1, 8),
       direct=hs.booleans(), fill=hs.floats(0, 1), steps=hs.integers(1, 3), seed=hs.integers(0, 2**31 - 1))
def test_selection_order_against_reference(hot_map, S, k, B, L, TT, direct, fill, steps, seed):
    """One top-k query a request in selection order: the same plans and state as the reference (B < k
    often: misses overflow the victims)."""
    g = torch.Generator().manual_seed(seed)
    st, top = random_state(g, S, B, L, TT, direct, fill, seed)
    distinct_steps(Pair(st, hot_map=hot_map), g, S, k, top, steps, PlanWorkspace(DEV), miss_order="selection")


def test_the_orders_differ_and_selection_keeps_entry_order():
    """Misses entered in descending host order: "host" copies them ascending, "selection" as entered; with
    two victims for five misses, each order's first two take them (the overflow differs)."""
    st = make_state(S=1, B=2, L=64, TT=4)
    st.host_table = torch.arange(st.host_table.numel()).view(1, -1)  # host order = position order
    sel = torch.tensor([[[40, 31, 22, 13, 4]]])
    plans = {}
    for order in ("host", "selection"):
        want, _ = Pair(st).step(sel, [0], now=3, distinct=True, miss_order=order)
        plans[order] = want
    host, selection = plans["host"], plans["selection"]
    assert torch.equal(host.copy_src, torch.sort(host.copy_src).values)
    assert host.loc[0, 0, :3].tolist() == [-1, -1, -1] and (host.loc[0, 0, 3:] >= 0).all()
    assert selection.loc[0, 0, :2].ge(0).all() and selection.loc[0, 0, 2:].tolist() == [-1, -1, -1]
    assert selection.copy_src[0] > selection.copy_src[1]
    assert host.counters.overflow == selection.counters.overflow == 3


@pytest.mark.parametrize("B", [96, 4096], ids=["overflow", "room"])
def test_chunked_path_in_selection_order(B):
    """K*k past 2,048 (the chunked path): distinct entries in selection order, two steps on one state."""
    g = torch.Generator().manual_seed(5)
    st = make_state(S=2, B=B, L=6000, TT=8)
    fill_hot(st, 1, list(range(0, 192, 3))[:64], [int(v) for v in torch.randint(0, 5, (64,), generator=g)])
    p = Pair(st)
    for now in range(2):
        p.step(_distinct_sel(g, 2, 2100, torch.tensor([6000, 6000])), [1, 0], now=10 + now, distinct=True,
               miss_order="selection")


def test_fused_copy_in_selection_order():
    """plan_triton(copy=...) copies the rows a selection-order plan names, as plan + run_copies does."""
    g = torch.Generator().manual_seed(9)
    st, top = random_state(g, 3, 12, 40, 4, True, 0.5, 9)
    host, dev = _rows(st, 2, 8, 9)
    pair, got = Pair(st), dev.clone().to(DEV)
    for now in range(3):
        slots = torch.randperm(3, generator=g)[:2]
        sel = _distinct_sel(g, 2, 10, top[slots])
        want = plan_reference(sel, slots, pair.ref, now, miss_order="selection")
        src = host.pin_memory() if DEV == "cuda" else host
        plan = plan_triton(sel.to(DEV), slots.to(DEV), pair.dev, now, distinct=True, copy=(src, got),
                           miss_order="selection")
        assert torch.equal(plan.copy_src.cpu(), want.copy_src) and torch.equal(plan.loc.cpu(), want.loc)
        for layer in range(host.shape[1]):
            run_copies(want, host[:, layer], dev[:, layer])
        assert torch.equal(got.cpu(), dev)


def test_the_rule():
    """Selection order for distinct calls under SELECTION_ORDER_ENTRIES entries in all; host order else."""
    assert miss_order_for(8, 2048, True) == "selection"  # the batch-8 cases
    assert miss_order_for(16, 2048, True) == "host"  # exactly the threshold
    assert miss_order_for(1, SELECTION_ORDER_ENTRIES - 1, True) == "selection"
    assert miss_order_for(32, 2048, True) == "host"
    assert miss_order_for(2, 8, False) == "host"  # a verification union: representatives are not first entries


def test_bad_miss_orders_are_refused():
    st = make_state(S=1, B=4, L=32, TT=4)
    sel = torch.tensor([[[3, 5]]])
    with pytest.raises(ValueError, match="miss_order"):
        plan_reference(sel, torch.tensor([0]), clone_state(st), 1, miss_order="address")
    with pytest.raises(ValueError, match="miss_order"):
        plan_triton(sel.to(DEV), torch.tensor([0], device=DEV), clone_state(st, DEV), 1, miss_order="address")
    with pytest.raises(ValueError, match="distinct=True"):
        plan_triton(sel.to(DEV), torch.tensor([0], device=DEV), clone_state(st, DEV), 1, miss_order="selection")


def test_the_engine_plans_small_decode_calls_in_selection_order():
    """hisparse with a hot cache smaller than its prompts: every resolver call of a decode step (one query a
    request, two requests) plans in selection order, and the tokens are full serving's."""
    llm = LLM("tiny", preset="hisparse", hot_cache_rows=16, page_size=16, debug_checks=True)
    kv = llm.engine.store
    plan, orders = kv.plan_fn, []

    def recorded(*a, **k):
        orders.append(k.get("miss_order"))
        return plan(*a, **k)

    kv.plan_fn = recorded
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(96)] for i in range(2)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in LLM("tiny").generate(prompts, sp)]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    assert orders and set(orders) == {"selection"}
