"""Rows a resolver call does not place in the hot cache: the call-level direct path and
verification staging (eq. 11).

A verification union of K queries can exceed the B-row hot cache even when each selection fits;
its misses with no LRU victim go to the request slot's staging rows (K_max * k per slot): each
distinct row copied from host once, its location given to every query that selected it. Staged
rows are not cached, so the hot cache keeps its LRU order.

  stage_overflow           host-side (reference resolver): per request, torch.unique of the misses
  stage_overflow_deferred  device-side (Triton resolver, no sync): rank each request's distinct
                           missing rows by position, write locations back; same rows, same order
                           (kernels/stage_overflow.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.core.rows import SPACE
from dhisparse.kernels import backend as kernel_backend
from dhisparse.kernels.resolver_ref import ResolveCounters, ResolvePlan
from dhisparse.kernels.stage_overflow import stage_overflow_torch, stage_overflow_triton


@dataclass
class DirectPlan:
    """A call known on the host to resolve wholly directly (every complete history page of every
    decoding request published; `HierContext` then locates through its table): counts [6] device
    counters (selected entries, distinct direct rows), or None when the pass is counted on the host
    (`HierContext.host_counted`). No resolver launch, no copies."""

    counts: torch.Tensor | None


def direct_plan(sel: torch.Tensor, slots: torch.Tensor, kv) -> ResolvePlan | None:
    """The call-level direct path: when every selected row of every request is in its tail or in
    its ready optional map, return the locations without a resolver call (no hot-cache scan, no
    copy, hot-cache state untouched, as the full resolver would leave it). None otherwise.
    sel [N, K, k] positions (-1 padding); slots [N]."""
    valid = sel >= 0
    s = slots.to(sel.device)[:, None, None].expand_as(sel)
    pos = sel.clamp(min=0)
    start = kv.tail_start[s]
    tail = kv.tail_loc[s, (pos - start).clamp(0, kv.tail_loc.shape[1] - 1)]
    opt_map = kv.opt_loc  # the ready optional map (adaptive), None in the base hierarchy
    opt = opt_map[s, pos.clamp(max=opt_map.shape[1] - 1)] if opt_map is not None else torch.full_like(pos, -1)
    loc = torch.where(pos >= start, tail, opt)
    if not bool(((loc >= 0) | ~valid).all()):
        return None
    distinct = torch.unique(s[valid] * SPACE + pos[valid]).numel()
    empty = torch.zeros(0, dtype=torch.int64, device=sel.device)
    counters = ResolveCounters(int(valid.sum()), distinct, 0, 0, 0, 0)
    return ResolvePlan(torch.where(valid, loc, torch.full_like(loc, -1)), empty, empty, counters)


def stage_overflow(plan: ResolvePlan, sel: torch.Tensor, slots: torch.Tensor, kv) -> tuple[ResolvePlan, ResolvePlan | None]:
    """Rows of a request's union that found no hot-cache victim (the union of K queries can exceed
    B) go to the slot's staging rows: each distinct row copied from host once, its location given
    to every query that selected it. Staged rows are not cached: the hot cache keeps LRU order."""
    missing = (sel >= 0) & (plan.loc < 0)
    if not bool(missing.any()):
        return plan, None
    if kv.stage_loc is None:
        raise RuntimeError("a request's selections exceed its hot cache but the store has no staging arena; "
                           "build it with max_queries = the verification width")
    src, dst, loc, staged, entries = [], [], plan.loc.clone(), 0, 0
    host_ps = kv.host.page_size
    for i in missing.any(-1).any(-1).nonzero().squeeze(1).tolist():
        s, m = int(slots[i]), missing[i]
        uniq, inv = torch.unique(sel[i][m], return_inverse=True)
        rows = kv.stage_loc[s, : uniq.numel()]
        table = kv.host_table[s].to(uniq.device)
        src.append(table[uniq // host_ps] * host_ps + uniq % host_ps)
        dst.append(rows)
        loc[i][m] = rows[inv]
        staged, entries = staged + uniq.numel(), entries + int(m.sum())
    c = plan.counters._replace(host=plan.counters.host + staged, host_selected=plan.counters.host_selected + entries)
    dev = plan.copy_dst.device
    stage_plan = ResolvePlan(loc, torch.cat([t.to(dev) for t in src]), torch.cat([t.to(dev) for t in dst]) - SPACE, c)
    return ResolvePlan(loc, plan.copy_src, plan.copy_dst, c), stage_plan


@dataclass
class StagePlan:
    """A deferred staging plan, the padded copy form `launch_copies` takes:
    src_pad / dst_pad [N, KK] int64 host rows / staging-arena rows of each request's distinct
    staged rows (first copy_n[n] valid, ascending position); copy_n [N] int32; counts [6] int64
    device counters to add to the call's (host += distinct staged, host_selected += entries)."""

    src_pad: torch.Tensor
    dst_pad: torch.Tensor
    copy_n: torch.Tensor
    counts: torch.Tensor


def stage_overflow_deferred(plan, sel: torch.Tensor, slots: torch.Tensor, kv) -> StagePlan:
    """Device-side `stage_overflow` for a deferred Triton plan: rewrites plan.loc for the misses
    that found no victim (staging locations, SPACE-encoded) and returns their copy plan. No op
    waits for the device. sel [N, K, k] positions (-1 padding); slots [N] int64 (device). The work is
    kernels/stage_overflow.py's one-launch Triton form (3.3-5.5x faster than its plain-PyTorch form at a
    glm5-faithful round's shape on an H100, bench/results/stage_overflow_s50_h100.json), or, with the kernel
    settings' `stage_kernel` off (DHISPARSE_STAGE_KERNEL=0 at engine build), the PyTorch form; the same
    outputs bit for bit."""
    fn = stage_overflow_triton if kernel_backend.settings().stage_kernel else stage_overflow_torch
    return StagePlan(*fn(sel, plan.loc, slots.to(sel.device), kv.stage_loc, kv.host_table, kv.host.page_size))
