"""Triton resolver: `plan_triton` (fused plan kernel) and `run_copies_triton` (fused gather-copy).

Same semantics as `dhisparse.kernels.resolver_ref.plan_reference` / `run_copies`, bit for bit, in outputs
and in state mutations (hot_pos, hot_stamp). On CPU the kernels run under TRITON_INTERPRET=1.

Plan / run like FlashInfer:

    plan = plan_triton(sel, slots, st, now)               # one launch, grid = N requests
    nbytes = run_copies_triton(plan, host_rows, dev_rows)  # one launch per layer of the group

`plan_triton(..., defer=True)` does not synchronise (no .item / .tolist / bool of a device tensor,
also when every row resolves directly): `plan.loc` and the padded copy plan (`src_pad`, `dst_pad`,
`copy_n`) and the per-request device counters `cnt` are ready on the stream (`counts`, their sum, is
computed on first use); `copy_src`, `copy_dst` and `counters` are None until `plan.materialize()`
(one sync). `launch_copies` runs the copies of a deferred plan without synchronising. A call is one
kernel launch (two with an optional map: P0's pre-pass), with no fills or reductions when `now` is a
device tensor and a workspace is given; a request whose valid rows all resolve directly (tail or
optional map) exits after writing its locations and counters, with copy_n = 0 and its hot-cache
state untouched.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch

from dhisparse.kernels.gather import RowCopy, gather_rows, gather_rows_padded, row_copy
from dhisparse.core.rows import next_pow2, row_bytes
from dhisparse.kernels.launch import CompiledLaunch
from dhisparse.kernels.resolver_kernel import direct_pre_kernel, resolve_plan_kernel
from dhisparse.kernels.resolver_ref import ResolveCounters, ResolvePlan, ResolverState, check_miss_order
from dhisparse.kernels.resolver_args import reused_outputs, state_args, state_tensors
from dhisparse.kernels.resolver_workspace import PlanWorkspace

__all__ = ["TritonResolvePlan", "PlanWorkspace", "plan_triton", "run_copies_triton", "launch_copies", "launch_copies_into",
           "COUNTER_NAMES"]

COUNTER_NAMES = ResolveCounters._fields
MAX_KK = 65535  # selection entries per request (resolver_kernel's packed counts)
MAX_B = 32768  # hot rows a slot (resolver_evict._victims' packed running counts)
PHASE_STOPS = {0: "P0 prologue", 10: "P1 entries", 30: "P3 hot scan", 41: "P4a-b misses, victims", 43: "P4c sorted",
               45: "P4 misses"}  # upto_phase values below the full plan (50)
_PRE = CompiledLaunch(direct_pre_kernel)
_PLAN = CompiledLaunch(resolve_plan_kernel)


@dataclass
class TritonResolvePlan(ResolvePlan):
    """ResolvePlan plus the kernel's padded per-request copy plan.

    src_pad, dst_pad [N, C] int64: row r < copy_n[n] of request n is (host location, device location),
    in the plan's miss order within the request (C = min(K*k, B)); copy_n [N] int64;
    cnt [N, 6] int64 per-request device counters in `ResolveCounters` order; `counts` [6] their sum
    (a device tensor, computed once on first use).
    copy_src [M], copy_dst [M], counters: None while deferred, filled by `materialize()`.
    """

    src_pad: torch.Tensor | None = None
    dst_pad: torch.Tensor | None = None
    copy_n: torch.Tensor | None = None
    cnt: torch.Tensor | None = None
    _counts: torch.Tensor | None = None
    copied: bool = False  # plan_triton(copy=...): the plan kernel already copied its rows into that target

    @property
    def counts(self) -> torch.Tensor:
        """[6] int64 device tensor: counters summed over requests (no sync)."""
        if self._counts is None:
            self._counts = self.cnt.sum(0)
        return self._counts

    @property
    def deferred(self) -> bool:
        """`ResolvePlan.deferred`: the counters (and compact copy plan) are not read yet."""
        return self.counters is None

    def materialize(self) -> "TritonResolvePlan":
        """Compact the copy plan to [M] (request order, miss order within) and read the counters.
        Synchronises with the device once. Idempotent."""
        if self.counters is None:
            keep = torch.arange(self.src_pad.shape[1], device=self.src_pad.device)[None, :] < self.copy_n[:, None]
            self.copy_src = self.src_pad[keep]
            self.copy_dst = self.dst_pad[keep]
            self.counters = ResolveCounters(*(int(v) for v in self.counts.tolist()))
        return self


def plan_triton(sel: torch.Tensor, slots: torch.Tensor, st: ResolverState, now: "int | torch.Tensor", *,
                defer: bool = False, num_warps: int | None = None, upto_phase: int = 50,
                workspace: PlanWorkspace | None = None, distinct: bool = False,
                copy: "tuple[torch.Tensor, torch.Tensor] | RowCopy | None" = None,
                miss_order: str = "host") -> TritonResolvePlan:
    """Fused resolver plan. sel [N, K, k] positions (-1 padding); slots [N] distinct request slots.

    now: the LRU stamp, an int or an int64 device tensor (its first element is read by the kernel,
    not the host). Mutates st.hot_pos / st.hot_stamp [S, B] (and st.hot_entry) exactly like `plan_reference`. Returns
    loc [N, K, k] (dtype of sel) and the copy plan; see `TritonResolvePlan`. defer=True: no host sync.
    upto_phase < 50 (one of PHASE_STOPS) is for phase profiling only (bench/resolver_peer.py): the kernel
    stops after that phase (resolver_kernel.py's P1-P5) and the plan is incomplete.
    workspace: persistent scratch (`PlanWorkspace`, one per store): no scratch allocation and no
    zero-fill launch per call; None allocates per call. With `workspace.reuse_outputs` (an experiment:
    DHISPARSE_PLAN_OUTPUT_REUSE=1) the outputs come from a block an earlier call of this shape made, once
    nothing holds that call's plan or a view of it (`resolver_args.OutBlock.free`): no allocation and no views made.
    distinct: the caller guarantees that no request's K*k entries hold a position twice (one top-k
    query a request, K == 1, as the engine's decode step): the kernel then skips deduplication (the
    claims' read-back, one dependent round of K*k scattered loads) when K*k <= 2,048. A duplicate
    under distinct=True gives a wrong plan (two slots for one row); the default deduplicates.
    copy: (host_rows, dev_rows) as `launch_copies` takes them (layered [pages, G, ps, W] included), or a
    `RowCopy` of them: the plan kernel copies each request's planned rows itself after planning them
    (P6): one launch plans and copies, as `plan` + `launch_copies` into that pair would, and the plan
    comes back with `copied` set (its copy plan is still there for other layers' row spaces).
    miss_order: "host" (misses sorted by host location before they take victims) or "selection" (in
    the order of their entries: no sort; needs distinct=True, since a repeated position's representative
    is whichever entry won its claim), as `plan_reference` takes it; `resolver_ref.miss_order_for`
    picks one for a call's shape.
    Host cost: a handful of tensor ops (one output allocation and its views) and one or two kernel
    launches through their held compiled handles (kernels/launch.py); with a workspace, a repeat of
    an earlier call's state, shape, options and copy target (a `RowCopy`, as a store keeps them)
    launches through that call's bound launches, passing only sel, slots, the tail starts, now and
    the outputs (`_launch`).
    """
    if sel.dim() != 3:
        raise ValueError(f"sel must be [N, K, k], got {tuple(sel.shape)}")
    check_miss_order(miss_order)
    if miss_order == "selection" and not distinct:
        raise ValueError("miss_order='selection' needs distinct=True (a repeated position's representative is not its "
                         "first entry)")
    dev = st.hot_pos.device
    N, K, k = sel.shape
    KK = K * k
    if KK > MAX_KK:
        raise ValueError(f"K*k must be at most {MAX_KK} (the plan kernel counts rows in 16 bits), got {KK}")
    B = st.hot_pos.shape[1]
    if B > MAX_B:
        raise ValueError(f"hot_pos: at most {MAX_B} hot rows a slot (the plan kernel ranks victims in 16 bits), got {B}")
    C = max(1, min(KK, B))
    if not (N and KK):
        loc = torch.full(sel.shape, -1, dtype=sel.dtype, device=dev)
        z = torch.zeros((N, C), dtype=torch.int64, device=dev)
        plan = TritonResolvePlan(loc, None, None, None, z, z.clone(), torch.zeros(N, dtype=torch.int64, device=dev),
                                 torch.zeros((N, 6), dtype=torch.int64, device=dev), copied=copy is not None)
        return plan if defer else plan.materialize()
    if sel.device != dev:
        sel = sel.to(dev)
    if not sel.is_contiguous():  # the kernel reads sel and writes loc as [N, K*k] row-major
        sel = sel.contiguous()
    if slots.dtype != torch.int64 or slots.device != dev or not slots.is_contiguous():
        slots = slots.to(device=dev, dtype=torch.int64).contiguous()
    loc, src, dst, cnt, copy_n = reused_outputs(workspace, tuple(sel.shape), C, sel.dtype, dev)
    rc = copy if copy is None or isinstance(copy, RowCopy) else row_copy(*copy)
    plan = TritonResolvePlan(loc, None, None, None, src, dst, copy_n, cnt, copied=rc is not None and upto_phase >= 50)
    # a (host_rows, dev_rows) pair makes a new RowCopy each call: nothing to hold a launch against
    _launch(sel, slots, st, now, plan, N, KK, B, C, num_warps, upto_phase, workspace, distinct, rc,
            bind=copy is None or copy is rc, host_order=miss_order == "host")
    return plan if defer else plan.materialize()


plan_triton.deferrable = True  # HierContext calls it with defer=True and reads counters lazily


@functools.lru_cache(maxsize=64)
def _sort_classes(smax: int) -> tuple[int, int, int, int]:
    """Four distinct power-of-two sort sizes ending at smax: (32, 128, 512, 2048) up to 2,048, else
    (32, 512, 2048, smax) (a round's few misses sort in a 32-wide block, 20% of a 2,048 selection
    in a 512-wide one)."""
    base = (32, 128, 512, 2048) if smax <= 2048 else (32, 512, 2048)
    cs = sorted({c for c in base if c < smax} | {smax})
    while len(cs) < 4:
        cs.insert(0, max(2, cs[0] // 2))
    return tuple(cs[-4:])


def _claim_dtype(KK: int) -> torch.dtype:
    """Element type of the claim table pv: it holds entry indices < K*k."""
    return torch.int16 if KK <= 32767 else torch.int32


@functools.lru_cache(maxsize=256)
def _shape_consts(KK: int, B: int) -> tuple[int, int, int, tuple[int, int, int, int]]:
    """(KKP, BP, default num_warps, sort classes) of a K*k / B pair. Warps (H200, bench/results/
    resolver_probe_s27c_h200.json): 32 from 8,192 entries or slots (K 8 unions 6-18% faster than at 16,
    H 8,192 up to 24%), 16 at 4,096 (32 is 3-4% slower with 20% misses)."""
    KKP, BP = next_pow2(max(KK, 1)), next_pow2(max(B, 1))
    big = max(KKP, BP)
    warps = 4 if big <= 512 else (8 if big <= 2048 else (16 if big <= 4096 else 32))
    return KKP, BP, warps, _sort_classes(min(KKP, BP))


def _copy_args(rc: RowCopy | None, dummy: torch.Tensor, warps: int) -> tuple[tuple, dict]:
    """The plan kernel's fused-copy arguments (crs, crd, CG and the eight strides) and constexprs;
    without a copy a dummy pointer and zeros (COPY=0 compiles P6 out). CR rows a chunk: at most 8 units a
    thread of what `copy_row_block` holds in flight (a row's column blocks, `RowCopy.width_in_flight`),
    a power of two up to 64 (16 warps, 656-B rows as two 64-unit blocks of 8 B: 32 rows, 21 KB a round)."""
    if rc is None:
        return (dummy, dummy, 0, 1, 0, 0, 0, 1, 0, 0, 0), {"COPY": 0}
    return ((rc.src, rc.dst, rc.layers, *rc.strides),
            {"COPY": 1, "CPW": rc.W, "CCW": rc.CW, "CVEC": rc.VEC, "CR": fused_copy_rows(warps, rc.width_in_flight)})


def fused_copy_rows(warps: int, in_flight: int) -> int:
    """CR of the fused copy: rows a chunk at `warps` warps when each row holds `in_flight` units."""
    return min(64, 1 << max(0, (warps * 256 // in_flight).bit_length() - 1))


# the plan kernel's and P0's per-call tensors (BoundLaunch live positions): sel, slots, tail_start,
# now, then the outputs loc, src_pad, dst_pad, copy_n, cnt; P0: sel, slots, tail_start, loc
_PLAN_LIVE = (0, 1, 10, 21, 22, 23, 24, 25, 26)
_PRE_LIVE = (0, 1, 3, 10)


@dataclass(eq=False)
class _Bound:
    """A workspace's held launches of one (state, shape, options) call (`_launch`), valid while the
    state holds the same tensors (and page size), the copy target and the workspace's buffers are
    the ones they were bound with (identity-checked; held here, so the ids in the key stay unique)."""

    st: ResolverState
    tensors: tuple  # state_tensors(st) when bound
    ps: int
    rc: object
    gen: int
    pre_grid: tuple
    pre: object  # BoundLaunch or None (no optional map)
    plan: object

    def valid(self, st: ResolverState, rc, gen: int) -> bool:
        return (self.st is st and self.rc is rc and self.gen == gen and self.ps == st.host_page_size
                and all(map(operator.is_, self.tensors, state_tensors(st))))


_BOUND_MAX = 256  # held launches per workspace (a store makes one per group, shape and option set)


def _launch(sel, slots, st, now, plan, N, KK, B, C, num_warps, upto=50, ws=None, distinct=False, rc=None, bind=True,
            host_order=True):
    """Both kernels' launches for sel [N, K, k] (contiguous: read as [N, K*k]) into `plan`; with a
    RowCopy `rc`, the plan kernel copies the planned rows into it (P6). With a workspace, a call
    whose state tensors, workspace buffers, copy target, shape and options were seen before launches
    through that call's held `BoundLaunch`es (kernels/launch.py): only the per-call tensors (sel,
    slots, tail_start, now, the plan's outputs) are passed again."""
    now_t = now if isinstance(now, torch.Tensor) else torch.full((1,), int(now), dtype=torch.int64, device=st.hot_pos.device)
    key = None
    if ws is not None and bind:
        key = (id(st), id(rc), N, KK, B, C, num_warps, upto, distinct, host_order, sel.dtype, slots.dtype, now_t.dtype)
        b = ws.launches.get(key)
        if b is not None and b.valid(st, rc, ws.generation):
            if b.pre is not None:
                b.pre(b.pre_grid, sel, slots, st.tail_start, plan.loc)
            b.plan((N,), sel, slots, st.tail_start, now_t, plan.loc, plan.src_pad, plan.dst_pad, plan.copy_n, plan.cnt)
            return
    pre, main = _calls(sel, slots, st, state_args(st), now_t, plan, N, KK, B, C, num_warps, upto, ws, distinct, rc,
                       host_order)
    if pre is not None:
        _PRE(*pre)
    _PLAN(*main)
    if key is not None:
        bp = _PLAN.bind(*main[1:], live=_PLAN_LIVE)
        bpre = _PRE.bind(*pre[1:], live=_PRE_LIVE) if pre is not None else None
        if bp is not None and (pre is None or bpre is not None):
            if len(ws.launches) >= _BOUND_MAX:
                ws.launches.pop(next(iter(ws.launches)))
            ws.launches[key] = _Bound(st, state_tensors(st), st.host_page_size, rc, ws.generation,
                                      pre[0] if pre is not None else (), bpre, bp)


def _calls(sel, slots, st, a, now_t, plan, N, KK, B, C, num_warps, upto, ws, distinct, rc, host_order=True):
    """(P0's launch or None, the plan kernel's launch), each (grid, args, consts, num_warps)."""
    s_pos, s_stamp, s_loc, s_tail, s_table, s_dmap, s_hmap = a.strides
    hot_pos, hot_stamp, hot_loc, tail_loc, table, dmap, hmap = state_tensors(st)
    dev, ps = hot_pos.device, st.host_page_size
    TT, HPW, LMAX, lcap, words = a.TT, a.HPW, a.LMAX, a.lcap, a.words
    # sorted key sets (misses kept, their victims) never exceed min(K*k, B) entries: sizing the sort
    # classes by that keeps a large hot cache from compiling (and shared-memory sizing) a B-wide sort
    KKP, BP, warps, (SA, SB, SC, SD) = _shape_consts(KK, B)
    if ws is not None:  # persistent: pre and the bitmap half the parity names zero at entry; the kernels keep it so
        scr64, scr32, pv, bm, half, pre = ws.scratch(N, KKP, BP, lcap, _claim_dtype(KK), words, dmap is not None)
        hitf = ws.hit_flags(N, BP) if hmap is not None else scr32
    else:
        scr64 = torch.empty((N, 2 * KKP + BP), dtype=torch.int64, device=dev)
        scr32 = torch.empty((N, 2 * KKP), dtype=torch.int32, device=dev)
        pv = torch.empty((N, lcap), dtype=_claim_dtype(KK), device=dev)  # P1's claims: any contents
        half = N * words if dmap is not None else 0  # two halves, parity, arrivals (resolver_workspace.py)
        bm = torch.zeros(2 * half + 2, dtype=torch.int32, device=dev) if dmap is not None else scr32
        pre = torch.zeros((N, 3), dtype=torch.int32, device=dev) if dmap is not None else None
        hitf = torch.empty((N, BP), dtype=torch.int8, device=dev) if hmap is not None else scr32  # any contents
    warps = num_warps or warps
    cargs, cconsts = _copy_args(rc, hot_pos, warps)
    chp = min(KKP, 1024)
    pre_call = None
    if dmap is not None:  # P0 over (request, chunk) programs: an all-direct call is one short pass
        J = -(-KK // chp)
        pre_call = ((N, J), (sel, slots, KK, st.tail_start, tail_loc, s_tail, TT, dmap, s_dmap, LMAX, plan.loc, bm, words,
                             half, pre, N * J), {"CH": chp}, 4)
    return pre_call, ((N,), (
        sel, slots, KK, hot_pos, hot_stamp, hot_loc, s_pos, s_stamp, s_loc, B,
        st.tail_start, tail_loc, s_tail, TT, table, s_table, HPW,
        dmap if dmap is not None else hot_pos, s_dmap, LMAX, int(dmap is not None), now_t,
        plan.loc, plan.src_pad, plan.dst_pad, plan.copy_n, plan.cnt, C,
        scr64, scr32, pv, lcap, pre if pre is not None else scr32, *cargs,
        hmap if hmap is not None else hot_pos, s_hmap, hitf),
        {"MAP": hmap is not None, "PS": ps, "KKP": KKP, "PRE": pre is not None, "BP": BP, "CH": min(KKP, 2048),
         "CHB": min(BP, 2048), "SA": SA, "SB": SB, "SC": SC, "SD": SD, "UPTO": upto, "DISTINCT": bool(distinct),
         "HOSTORD": bool(host_order), **cconsts},
        warps)


def launch_copies(plan: TritonResolvePlan, host_rows: torch.Tensor, dev_rows: torch.Tensor) -> None:
    """Copy the plan's host rows into device rows for one layer without synchronising.
    host_rows [HP, ps, W] (pinned CPU on CUDA: read zero-copy), dev_rows [P, ps, W]."""
    gather_rows_padded(host_rows, dev_rows, plan.src_pad, plan.dst_pad, plan.copy_n)


def launch_copies_into(plan: TritonResolvePlan, target: RowCopy) -> None:
    """`launch_copies` into a prepared row-space pair (`gather.row_copy`)."""
    gather_rows(target, plan.src_pad, plan.dst_pad, plan.copy_n)


def run_copies_triton(plan: ResolvePlan, host_rows: torch.Tensor, dev_rows: torch.Tensor) -> int:
    """Fused gather-copy of one layer's missed rows; same effect as `run_copies`. Returns bytes
    moved (materialises a deferred plan: one sync). Accepts reference plans too."""
    if isinstance(plan, TritonResolvePlan) and plan.src_pad is not None:
        launch_copies(plan, host_rows, dev_rows)
        plan.materialize()
        m = plan.copy_src.numel()
    else:
        m = plan.copy_src.numel()
        if m:
            src = plan.copy_src.to(dev_rows.device).reshape(1, m)
            dst = plan.copy_dst.to(dev_rows.device).reshape(1, m)
            gather_rows_padded(host_rows, dev_rows, src, dst, torch.full((1,), m, dtype=torch.int32,
                                                                          device=dev_rows.device))
    return m * row_bytes(dev_rows)
