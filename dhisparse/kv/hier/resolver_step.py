"""The resolver step of one selection group, shared by `HierContext` (kv/hier/context.py; GLM: a
group is a producer layer and its followers) and `V4HierPass` (kv/v4/hier_pass.py; DeepSeek-V4: a
group is one CSA source, its own arena layer, with no followers):

    decode_tokens / DecodeTokens   where the decoding requests' tokens sit in the flattened batch
    per_request                    selection [T, k] -> [Nd, K, k] (index ops, -1 padded)
    locate_group                   -> locations [T, k] and the group's (plan, staged):
        resolve_group                the resolver call: deferred Triton plan + sync-free staging,
                                     or the reference path (call-level direct exit, host staging)
        DirectPlan                   an all-direct pass (no resolver call, device census or none)
    producer_rows                  the row spaces a group's producer copies its plan into, prepared
                                   once (producer_target): its gather launch's target, or under fused
                                   resolver copies the plan kernel's
    copy_group                     a layer's host -> device copies of the plan (+ census)
    flush_promotion                paper staging's promoted rows into the hot cache, after the group
    restage                        re-copy a group's staged rows into the shared staging arena
    decode_locations               the tail's (and ready map's) rows of decoding requests, per slot
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from dhisparse.core.rows import SPACE, row_bytes
from dhisparse.kernels.resolver_ref import ResolvePlan, miss_order_for
from dhisparse.kv.hier.promotion import Promotion, copy_layered_torch, flush, plan_promotion, rank_stamps
from dhisparse.kv.hier.staging import DirectPlan, StagePlan, direct_plan, stage_overflow, stage_overflow_deferred

try:  # Triton is optional: only a deferred (Triton) plan launches its copies here
    from dhisparse.kernels.gather import row_copy
    from dhisparse.kernels.resolver import launch_copies, launch_copies_into
except ImportError:  # no Triton on this machine: plans are never deferred
    launch_copies = launch_copies_into = row_copy = None


class DecodeTokens(NamedTuple):
    """Where decoding requests' tokens sit in a flattened batch: token tok[m] of the batch is
    query j[m] of decoding request i[m] (an index into the pass's decode_rows); n decoding
    requests, each with at most K tokens; dense: every token of the batch belongs to a decoding
    request and each has exactly K (then [T, k] <-> [n, K, k] is a view). tok / i / j [M] int64
    on the device.

        batch tokens   | prefill r0 ......... | dec r1: q0 q1 q2 | dec r2: q0 | ...
        per request    [n, K, k]: row i = decode_rows[i], column j = its j-th query
    """

    tok: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor
    n: int
    K: int
    dense: bool


def decode_token_lists(qs: list[int], decode_rows: list[int]) -> tuple[list[int], list[int], list[int], int, bool]:
    """Host lists (tok, i, j) of `DecodeTokens`, and its K and dense, for a batch with query
    starts `qs` whose decoding requests are the batch rows `decode_rows`."""
    tok, ii, jj = [], [], []
    for i, r in enumerate(decode_rows):
        n = qs[r + 1] - qs[r]
        tok.extend(range(qs[r], qs[r + 1]))
        ii.extend([i] * n)
        jj.extend(range(n))
    K = max((qs[r + 1] - qs[r] for r in decode_rows), default=1)
    return tok, ii, jj, K, len(tok) == qs[-1] == len(decode_rows) * K


def decode_tokens(qs: list[int], decode_rows: list[int], device) -> DecodeTokens:
    """`DecodeTokens` of a batch (one host -> device copy)."""
    tok, ii, jj, K, dense = decode_token_lists(qs, decode_rows)
    T = len(tok)
    m = torch.tensor(tok + ii + jj, dtype=torch.int64).to(device, non_blocking=True)
    return DecodeTokens(m[:T], m[T : 2 * T], m[2 * T :], len(decode_rows), K, dense)


def per_request(selection: torch.Tensor, dt: DecodeTokens) -> torch.Tensor:
    """[n, K, k] selections of the decoding requests (their missing queries -1) from a batch's
    selection [T, k] (positions, -1 padded): a view when dense, one indexed copy otherwise."""
    if dt.dense:
        return selection.view(dt.n, dt.K, selection.shape[1])
    out = selection.new_full((dt.n, dt.K, selection.shape[1]), -1)
    out[dt.i, dt.j] = selection[dt.tok]
    return out


def direct_counts(sel: torch.Tensor, dt: DecodeTokens) -> torch.Tensor:
    """[6] census counters of an all-direct call on selection [T, k]: selected entries and
    distinct rows (per request) of the decoding tokens; nothing from the hot cache or host."""
    s = sel if dt.dense else sel[dt.tok]
    selected = (s >= 0).sum()
    if dt.K == 1:  # one query per request: a top-k selection holds distinct positions
        return torch.cat([selected.expand(2), selected.new_zeros(4)])
    keys = torch.where(s >= 0, dt.i[:, None] * SPACE + s, -1).reshape(-1).sort().values
    distinct = ((keys[1:] != keys[:-1]) & (keys[1:] >= 0)).sum() + (keys[:1] >= 0).sum()
    return torch.cat([torch.stack([selected, distinct]), selected.new_zeros(4)])


def _check_distinct(per_req: torch.Tensor) -> None:
    """Debug check of the resolver's `distinct` contract: no request's selection [N, 1, k] holds a
    position twice (-1 padding aside). Synchronises."""
    s = per_req.flatten(1).sort(dim=1).values
    dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
    if bool(dup.any()):
        bad = dup.any(1).nonzero().flatten().tolist()
        raise AssertionError(f"a one-query selection repeats a position (requests {bad})")


def resolve_group(kv, g: int, per_req: torch.Tensor,
                  slots_t: torch.Tensor) -> tuple[ResolvePlan, ResolvePlan | StagePlan | None, Promotion | None]:
    """The resolver call of selection group g of hierarchy `kv`: per_req [Nd, K, k] positions of
    the decoding requests' queries (-1 padded, each request's K queries resolved as one union);
    slots_t [Nd] int64 on the device, their slots. Returns (plan, staged, promotion): plan.loc
    [Nd, K, k] locations (SPACE-encoded staging rows where staged), staged: the copy plan of union
    rows that found no hot-cache victim (None when none can exist / none did), promotion: paper
    staging's pending promotion of staged rows (kv/hier/promotion.py; None under single staging
    or when nothing can be staged).

    With a deferrable (Triton) resolver nothing here waits for the device: the kernel takes the
    direct path per request, the counters stay on the device, and rows of a verification union
    that found no hot-cache victim are staged by device ops (`stage_overflow_deferred`). With the
    reference resolver the call-level direct path (`direct_plan`) and staging read the plan on
    the host."""
    # one query a request: its top-k holds distinct positions, so the kernel skips deduplication, and a
    # small call fetches its misses in selection order (no sort: `miss_order_for`)
    distinct = per_req.shape[1] == 1
    order = miss_order_for(per_req.shape[0], per_req.shape[1] * per_req.shape[2], distinct)
    if kv.deferred:
        if distinct and kv.debug:
            _check_distinct(per_req)
        plan = kv.plan_fn(per_req, slots_t, kv.resolver_state(g), kv.now_t, defer=True, workspace=kv.plan_ws,
                          distinct=distinct, copy=producer_target(kv, g) if kv.fuse_copies else None,
                          miss_order=order)
        staged = None
        if per_req.shape[1] * per_req.shape[2] > kv.B_of[g]:
            staged = stage_overflow_deferred(plan, per_req, slots_t, kv)
    else:
        plan = direct_plan(per_req, slots_t, kv)
        if plan is None:
            plan = kv.plan_fn(per_req, slots_t, kv.resolver_state(g), kv.stamp_now, miss_order=order)
        else:
            kv.census.direct_calls += 1
        plan, staged = stage_overflow(plan, per_req, slots_t, kv)
    return plan, staged, _paper_round(kv, g, per_req, slots_t, plan, staged)


def _paper_round(kv, g: int, per_req: torch.Tensor, slots_t: torch.Tensor, plan, staged) -> Promotion | None:
    """Paper staging after group g's resolver call (kv/hier/promotion.py): rank the touched rows'
    stamps and, where the union could overflow the hot cache, plan the promotion of its staged rows.
    Nothing under single staging or for one query a request."""
    if kv.staging_mode != "paper" or per_req.shape[1] == 1:
        return None
    ranks, touched = rank_stamps(kv, g, per_req, slots_t)
    if per_req.shape[1] * per_req.shape[2] <= kv.B_of[g] or (staged is None and not kv.deferred):
        return None
    return plan_promotion(kv, g, ranks, touched, plan.loc, slots_t)


def locate_group(kv, g: int, selection: torch.Tensor, dt: DecodeTokens, slots_t: torch.Tensor, lat_of: torch.Tensor,
                 req_idx: torch.Tensor, all_direct: bool, count_direct: bool = True):
    """Resolve selection group g's selection [T, k] (positions, -1 padding) of a batch:
    prefilling requests' tokens read lat_of [N, W] (their workspace rows); decoding requests'
    tokens (dt, slots slots_t [Nd]) go through one resolver call (`resolve_group`), unless the
    pass is `all_direct` (every decoding request's history published: lat_of already holds every
    location, no resolver call; `count_direct`: the call's census is counted on the device, else
    the caller counted it on the host). req_idx [T]: each token's batch row.

    Returns (loc [T, k], plan, staged, promotion); plan is None when no request decodes, a
    `DirectPlan` when all-direct. Pass (plan, staged) to `copy_group` for every layer of the group,
    and a promotion to `promotion.flush` once the group's last layer has run."""
    plan = staged = promo = None
    if dt.n and not all_direct:
        plan, staged, promo = resolve_group(kv, g, per_request(selection, dt), slots_t)
        if dt.dense:  # every token decodes: the plan's locations are the pass's
            return plan.loc.reshape(selection.shape), plan, staged, promo
    loc = lat_of[req_idx[:, None], selection.clamp(min=0)].masked_fill_(selection < 0, -1)
    if dt.n and all_direct:  # lat_of already holds every location (decode_locations, direct)
        plan = DirectPlan(direct_counts(selection, dt) if count_direct else None)
    elif dt.n:
        loc[dt.tok] = plan.loc[dt.i, dt.j]
    return loc, plan, staged, promo


def producer_rows(kv, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(host rows, device rows) that group g's producer layer copies a deferred plan into
    (`copy_group`): its own layer's when each layer copies for itself (no layered span) or when the
    followers copy on the side stream (prefetch), else every layer of the group at once, layered
    [pages, G, ps, W]. Under fused resolver copies this is the plan kernel's target."""
    p = kv.groups[g]
    span = kv.group_span[g]
    if span is None or (kv.prefetch is not None and kv.followers[g]):
        return kv.host.layer_rows(p), kv.arena.latent_rows(p)
    return kv.host.rows[:, span], kv.arena.latent[:, span]


def producer_target(kv, g: int):
    """Group g's `producer_rows` prepared once (a `RowCopy`, kept in `kv.copy_targets`: the row spaces
    never move, so later calls skip the views and the layout probe): the producer's gather launch
    copies into it, or under fused resolver copies the plan kernel does."""
    target = kv.copy_targets.get(g)
    if target is None:
        target = kv.copy_targets[g] = row_copy(*producer_rows(kv, g))
    return target


def copy_group(kv, layer: int, plan, staged, rows: torch.Tensor, producer: bool,
               zero: torch.Tensor | None = None) -> None:
    """Layer `layer`'s host -> device copies of its group's (plan, staged) from `locate_group`
    into its row space `rows` [P, ps, W] (and staged rows into the staging arena); census update
    (by the producer: the call's counters and every layer's bytes). A deferred plan's copies for
    a whole group of consecutive layers are launched once, by the producer: followers would copy
    the same rows into their own row spaces, and nothing reads a follower's victim rows before
    the follower itself runs in this pass. With `kv.prefetch` (prefetch_stream "side") the
    producer copies its own rows and issues each follower's on the side stream; a follower waits
    for its own copy. The producer's copy (into `producer_rows`) is skipped when the plan kernel
    already made it (`plan.copied`: fused resolver copies). Staged rows share one buffer across
    layers, so each layer still stages its own. zero: a 0-d int64 device tensor (the bytes of a
    direct call)."""
    if isinstance(plan, DirectPlan):
        if producer and plan.counts is not None:  # None: counted on the host for the whole pass
            kv.census.add_device(plan.counts, zero if zero is not None else plan.counts.new_zeros(()))  # nothing copied
        return
    if plan.deferred:
        g = kv.group_of[layer]
        span = kv.group_span[g]
        own = producer and not plan.copied  # the producer's copy, unless the plan kernel made it
        if kv.prefetch is not None and kv.followers[g]:  # layer-wise prefetch (kv/hier/prefetch.py)
            if own:
                launch_copies_into(plan, producer_target(kv, g))
            if producer:
                kv.prefetch.issue({f: partial(launch_copies, plan, kv.host.layer_rows(f), kv.arena.latent_rows(f))
                                   for f in kv.followers[g]})
            else:
                kv.prefetch.wait(layer)
        elif span is None:  # each layer copies its own rows
            if own:
                launch_copies_into(plan, producer_target(kv, g))
            elif not producer:
                launch_copies(plan, kv.host.layer_rows(layer), rows)
        elif own:  # one layered launch copies the rows of every layer of the group
            launch_copies_into(plan, producer_target(kv, g))
        if staged is not None and kv.staging_mode == "paper":  # chi arenas: every layer's, once
            if producer:
                launch_copies(staged, kv.host.rows[:, span], kv.stage_arenas[:, : span.stop - span.start])
        elif staged is not None:
            launch_copies(staged, kv.host.layer_rows(layer), kv.stage)
        if producer:  # every layer of the group copies the same rows: count them all here, once
            copied, counts = plan.copy_n.sum(), plan.counts
            if staged is not None:
                copied, counts = copied + staged.copy_n.sum(), counts + staged.counts
            kv.census.add_device(counts, copied * (row_bytes(rows) * kv.group_size[kv.group_of[layer]]))
        return
    host = kv.host.layer_rows(layer)
    nbytes = kv.copy_fn(plan, host, rows)
    nbytes += kv.copy_fn(staged, host, kv.staging_rows(layer)) if staged is not None else 0
    if producer:
        kv.census.add(plan.counters, nbytes)
    else:
        kv.census.bytes_moved += nbytes


def flush_promotion(kv, promo: Promotion) -> None:
    """Apply a group's pending paper-staging promotion `promo` (from `locate_group`), in stream
    order after the group's last layer has run: launched copies on the deferred path, else torch's."""
    flush(kv, promo, launch_copies if kv.deferred else copy_layered_torch)


def restage(kv, layer: int, staged) -> "int | torch.Tensor":
    """Copy layer `layer`'s staged rows (`staged` from `locate_group`) into the staging arena
    again (another group's call refilled it since; no resolver call). Returns the bytes copied:
    an int (reference plans) or a 0-d device tensor (a deferred `StagePlan`: no sync)."""
    host = kv.host.layer_rows(layer)
    if isinstance(staged, StagePlan):
        launch_copies(staged, host, kv.stage)
        return staged.copy_n.sum().to(torch.int64) * row_bytes(kv.stage)
    return kv.copy_fn(staged, host, kv.stage)


def decode_locations(kv, slots_t: torch.Tensor, lens_t: torch.Tensor, W: int, direct: bool) -> torch.Tensor:
    """[N, W] latent locations of a hierarchy `kv`'s decoding requests in slots `slots_t` [N]
    with lens_t [N]: the tail's rows at tail_start .. len-1; with `direct` (every history page
    published, adaptive) the ready map's before the tail; -1 elsewhere (history: the resolver).
    Device ops only, from the slots' persistent state.

        positions   0 ........ tail_start ...... len-1 | len .. W-1
        locations   -1 / opt_loc[slot]  tail_loc[slot, 0 ..]  | -1
    """
    pos = torch.arange(W, device=kv.device)
    off = pos[None, :] - kv.tail_start[slots_t][:, None]
    tail = kv.tail_loc[slots_t].gather(1, off.clamp(0, kv.tail_loc.shape[1] - 1))
    out = torch.where((off >= 0) & (pos[None, :] < lens_t[:, None]), tail, -1)
    if direct:
        out = torch.where(off < 0, kv.opt_loc[slots_t, :W], out)
    return out
