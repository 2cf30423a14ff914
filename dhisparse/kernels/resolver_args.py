"""The plan kernel's host-side arguments: a `ResolverState`'s derived arguments (`state_args`: row strides,
the positions' bound, checked once per state) and the plan's output tensors (`outputs`, one int64 block carved
into views; `reused_outputs`: blocks a workspace keeps for later calls of one shape, `OutBlock`).

Used by `kernels/resolver.py` (`plan_triton`); no kernel here.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch

from dhisparse.kernels.resolver_ref import ResolverState, position_bound
from dhisparse.kernels.resolver_workspace import PlanWorkspace, capturing

__all__ = ["StateArgs", "state_args", "state_tensors", "outputs", "reused_outputs", "OutBlock", "OUT_POOL"]


STATE_NAMES = ("hot_pos", "hot_stamp", "hot_loc", "tail_loc", "host_table", "direct_loc", "hot_entry")


def row_stride(t: torch.Tensor, name: str) -> int:
    """The row stride of a 2-D state tensor, which must have a unit last stride (the kernel reads
    and updates its rows in place)."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got {tuple(t.shape)}")
    st = t.stride()
    if st[1] != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (the resolver reads its rows in place)")
    return st[0]


@dataclass(frozen=True)
class StateArgs:
    """What the plan kernel takes from a `ResolverState` besides its tensors: their row strides and
    the sizes derived from them. `refs`: weak references to the tensors they were read from."""

    refs: tuple
    strides: tuple  # (s_pos, s_stamp, s_loc, s_tail, s_table, s_dmap, s_hmap)
    ps: int  # the host page size lcap was derived with
    TT: int
    HPW: int
    LMAX: int
    lcap: int
    words: int


STATE_ARGS: dict[int, StateArgs] = {}  # id(state) -> its arguments, while its tensors are the same objects
STATE_ARGS_MAX = 256


def state_tensors(st: ResolverState) -> tuple:
    return st.hot_pos, st.hot_stamp, st.hot_loc, st.tail_loc, st.host_table, st.direct_loc, st.hot_entry


LCAP_MAX = 1 << 30  # positions a plan can claim (resolver_one._hot_scan_one packs (p << 1) | flag in int32)


def state_args(st: ResolverState) -> StateArgs:
    """The plan kernel's state arguments, derived once per state and reused while every tensor of the
    state is the same object (a store keeps its states: `HierarchicalKV.resolver_state`); weak
    references, so a kept entry holds no memory. Row layouts are checked on the first call: a state
    tensor without a unit last stride is refused (the plan reads and updates rows in place)."""
    ts = state_tensors(st)
    hit = STATE_ARGS.get(id(st))
    if (hit is not None and hit.ps == st.host_page_size
            and all((r() if r is not None else None) is t for r, t in zip(hit.refs, ts))):
        return hit
    strides = tuple(0 if t is None else row_stride(t, name) for t, name in zip(ts, STATE_NAMES))
    dmap = st.direct_loc
    TT, HPW, ps = st.tail_loc.shape[1], st.host_table.shape[1], st.host_page_size
    LMAX = dmap.shape[1] if dmap is not None else 0
    lcap = position_bound(st)  # positions are < the host table's reach + the tail (I1), or < the map's width
    if lcap > LCAP_MAX:  # the plan packs a claimed position and a flag into 31 bits
        raise ValueError(f"host_table / direct_loc: positions up to {lcap} exceed the plan kernel's 2^30")
    hmap = st.hot_entry
    if hmap is not None and (hmap.dtype != torch.int16 or hmap.shape[1] < lcap or hmap.shape[0] != st.hot_pos.shape[0]):
        raise ValueError(f"hot_entry must be int16 [S, >= {lcap}] (every position the plan can see: the host table's "
                         f"reach plus the tail, or the optional map's width), got {hmap.dtype} {tuple(hmap.shape)}")
    words = -(-lcap // 32) if dmap is not None else 1
    args = StateArgs(tuple(None if t is None else weakref.ref(t) for t in ts), strides, ps, TT, HPW, LMAX, lcap, words)
    if len(STATE_ARGS) >= STATE_ARGS_MAX:
        STATE_ARGS.pop(next(iter(STATE_ARGS)))
    STATE_ARGS[id(st)] = args
    return args


def output_block(shape: tuple[int, int, int], C: int, sel_dtype: torch.dtype, dev: torch.device):
    """(the tensors owning the outputs' storage: the int64 block, and loc when it is its own, (loc [N, K, k]
    contiguous, src [N, C], dst [N, C], cnt [N, 6], copy_n [N])), the outputs carved from one int64
    allocation (loc separately when the selection is not int64). The owners are returned because a view's
    `_base` is None under inference mode."""
    N, K, k = shape
    wide = sel_dtype == torch.int64
    lk = N * K * k if wide else 0
    blk = torch.empty(lk + N * (2 * C + 7), dtype=torch.int64, device=dev)
    o = lk + 2 * N * C
    loc = torch.as_strided(blk, shape, (K * k, k, 1), 0) if wide else torch.empty(shape, dtype=sel_dtype, device=dev)
    return (blk,) if wide else (blk, loc), (
        loc, torch.as_strided(blk, (N, C), (C, 1), lk), torch.as_strided(blk, (N, C), (C, 1), lk + N * C),
        torch.as_strided(blk, (N, 6), (6, 1), o), torch.as_strided(blk, (N,), (1,), o + 6 * N))


def outputs(shape: tuple[int, int, int], C: int, sel_dtype: torch.dtype, dev: torch.device):
    """(loc [N, K, k] contiguous, src [N, C], dst [N, C], cnt [N, 6], copy_n [N]) (`output_block`)."""
    return output_block(shape, C, sel_dtype, dev)[1]


OUT_POOL = 4  # output blocks kept per shape in a workspace (plans of one shape alive at once, e.g. a step's groups)
USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # private: without it no block is ever reused


def refs_of(views: tuple) -> tuple:
    """Python references to each view (the same count at creation and at the check: one helper)."""
    return tuple(map(sys.getrefcount, views))


def uses_of(ts: tuple) -> tuple:
    """Tensors (TensorImpls) sharing each tensor's storage: views derived from a plan's outputs count."""
    return tuple(USE_COUNT(t.untyped_storage()._cdata) for t in ts)


@dataclass(eq=False)
class OutBlock:
    """One call's output tensors (`outputs`), kept in a workspace for a later call of the same shape. Free when
    nothing outside holds them: each view's Python references and each storage's tensor count are what they
    were when the block was made (no plan, no view derived from one). Reusing a free block is as safe as the
    caching allocator's reuse of a freed one: blocks are kept per stream and calls on a stream are ordered
    (`PlanWorkspace`), and no capture takes one (a graph would bake its addresses while eager calls keep writing
    them)."""

    views: tuple  # (loc, src_pad, dst_pad, cnt, copy_n)
    bases: tuple  # the storages' owners: the int64 block (and loc when it is not a view of it)
    refs0: tuple = ()
    uses0: tuple = ()

    def free(self) -> bool:
        return USE_COUNT is not None and refs_of(self.views) == self.refs0 and uses_of(self.bases) == self.uses0


def reused_outputs(ws: PlanWorkspace | None, shape: tuple[int, int, int], C: int, sel_dtype: torch.dtype,
                    dev: torch.device) -> tuple:
    """`outputs` through the workspace's kept blocks (`OutBlock`) when it reuses outputs: a free block of this
    shape, else a new one kept (at most OUT_POOL a shape); plain `outputs` otherwise and inside a capture."""
    if ws is None or not ws.reuse_outputs or USE_COUNT is None or capturing(dev):
        return outputs(shape, C, sel_dtype, dev)
    # per stream, as the caching allocator keeps its blocks: a block is reused only on the stream it was made on
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    pool = ws.outputs.setdefault((shape, C, sel_dtype, stream), [])
    # a new tuple each call: a caller holding it holds the tensors, which the references then count (the
    # block's own tuple would hide them)
    for blk in pool:
        if blk.free():
            ws.outputs_reused += 1
            return (*blk.views,)
    bases, views = output_block(shape, C, sel_dtype, dev)
    if len(pool) < OUT_POOL:
        blk = OutBlock(views, bases)
        blk.refs0, blk.uses0 = refs_of(blk.views), uses_of(blk.bases)
        pool.append(blk)
    return (*views,)
