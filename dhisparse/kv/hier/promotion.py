"""Paper staging (§3.4, eq. 11; `staging_mode="paper"`): rank-ordered recency, promotion of staged
rows into the hot cache, and their copy-back once the group's readers are done.

A verification round's union U of K queries' selections can exceed the B-row hot cache; its misses
with no victim are staged (kv/hier/staging.py). Under `single` the staged rows are dropped after
the layer and fetched from host again when selected again. Under `paper`:

  rank     every distinct row u of a request's union gets rank(u) = (cnt - 1) * KS + (KS - 1 - jmin)
           (cnt: the queries that selected it, jmin: the first of them, KS = next_pow2(K_max)): rows
           more queries want rank higher, then rows an earlier query wants (a later query exists only
           if the earlier drafts are accepted). Our rule: the paper does not say which rows to keep.
  stamps   the resolver stamps every row it touches with now * KS^2 (`HierarchicalKV.stamp_now`);
           `rank_stamps` adds the row's rank, so the next rounds' LRU victims come by recency, then
           by rank within one round, instead of by slot id. K_max = 1 leaves stamps untouched.
  promote  a staged row replaces the weakest row touched this round when its rank is strictly
           higher (staged rows by rank descending paired with touched slots by rank ascending: the
           pairs that promote are a prefix). The hot cache then ends the round holding the union's
           highest-ranked rows. The resolver kernel still picks which misses take victims in
           host-address order (a union of several queries always plans in that miss order);
           promotion corrects the end state with a device-to-device copy.
  flush    the promoted rows' bytes (every layer of the group, from its staging arena) and their
           hot-cache state land together once the group's last layer has run: before the next
           group's locate, or at `HierContext.finish()` (the model calls it after its last layer,
           inside a step graph's capture too). Until then the arenas stay live (chi arenas: one per
           layer of a group) and the slots they replace keep their rows for this round's readers.

    per request   hot slots  v0 v1 v2 v3 (touched this round, ranks 1 5 2 7)
                  staged     u0 u1 u2    (ranks 6 3 0)
                  pairs      (u0: 6 > 1 v0) (u1: 3 > 2 v2) (u2: 0 < 5 v1: stop) -> u0 -> v0, u1 -> v2

Every op here is a fixed-shape device op (no host sync): a step graph records rank_stamps,
plan_promotion and flush. Masked-off state writes go to the hot tables' trailing trash entry.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dhisparse.core.rows import SPACE, row_bytes

BIG = torch.iinfo(torch.int64).max


class UnionRanks(NamedTuple):
    """A request batch's verification unions, sorted: skey [N, KK] positions ascending (BIG past
    the valid entries), order [N, KK] each sorted entry's flat index j * k + i in sel, first [N, KK]
    the first entry of each distinct row, rank [N, KK] int64 that row's rank (module docstring)."""

    skey: torch.Tensor
    order: torch.Tensor
    first: torch.Tensor
    rank: torch.Tensor


def union_ranks(sel: torch.Tensor, ks: int) -> UnionRanks:
    """Ranks of every distinct row of each request's union. sel [N, K, k] positions (-1 padding);
    ks = KS >= K. A stable sort keeps a row's entries in flat order, so its first entry holds its
    first query: jmin = order // k there."""
    N, K, k = sel.shape
    KK = K * k
    key = torch.where(sel >= 0, sel, BIG).reshape(N, KK)
    skey, order = key.sort(dim=1, stable=True)
    valid = skey != BIG
    first = valid.clone()
    first[:, 1:] &= skey[:, 1:] != skey[:, :-1]
    grp = (first.cumsum(1) - 1).clamp(min=0)  # distinct-row id of each sorted entry
    cnt = torch.zeros_like(skey).scatter_add_(1, grp, valid.to(torch.int64)).gather(1, grp)
    at = torch.arange(KK, device=sel.device).expand(N, KK)
    head = torch.where(first, at, 0).cummax(1).values  # each entry's row's first sorted entry
    jmin = (order // k).gather(1, head)
    rank = torch.where(valid, (cnt - 1) * ks + (ks - 1 - jmin), -1)
    return UnionRanks(skey, order, first, rank)


def _flat_index(kv, slots_t: torch.Tensor, g: int, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Flat indices into kv.hot_pos / hot_stamp's storage of (slot, group g, entry v), the trailing
    trash entry where not `keep`. slots_t [N]; v, keep [N, M]."""
    G, B = kv.hot_pos.shape[1], kv.hot_pos.shape[2]
    idx = (slots_t[:, None] * G + g) * B + v
    return torch.where(keep, idx, kv.hot_pos.numel())


def _stamp_base(kv, device) -> torch.Tensor:
    """[1] int64: this pass's stamp now * KS^2 on the device (the Triton resolver's `now_t`)."""
    return kv.now_t if kv.deferred else torch.full((1,), kv.stamp_now, dtype=torch.int64, device=device)


def rank_stamps(kv, g: int, sel: torch.Tensor, slots_t: torch.Tensor) -> tuple[UnionRanks, torch.Tensor]:
    """After group g's resolver call: every hot entry it touched (stamp == now * KS^2) gets its
    row's rank added. Returns the ranks and touched [N, B_g] (the entries touched this round, whose
    rank is then hot_stamp - now * KS^2). sel [N, K, k]; slots_t [N] (a step graph's padded
    requests repeat a real slot and select nothing: they write nothing)."""
    ur = union_ranks(sel, kv.rank_span)
    b, KK = kv.B_of[g], ur.skey.shape[1]
    base = _stamp_base(kv, sel.device)
    pos, stamp = kv.hot_pos[slots_t, g, :b], kv.hot_stamp[slots_t, g, :b]
    idx = torch.searchsorted(ur.skey, pos.contiguous()).clamp(max=KK - 1)
    found = (ur.skey.gather(1, idx) == pos) & (stamp == base)
    r = ur.rank.gather(1, idx)
    v = torch.arange(b, device=sel.device).expand_as(pos)
    kv._hot_stamp_flat[_flat_index(kv, slots_t, g, v, found)] = base + r
    return ur, found


class Promotion(NamedTuple):
    """Group g's pending promotion (`plan_promotion`): row r < copy_n[n] of request n moves staging
    row src_pad[n, r] into hot entry entry[n, r] (device location dst_pad[n, r] of every layer's row
    space), holding position pos[n, r] with stamp stamp[n, r]; keep [N, M] marks those rows. The
    padded form is `launch_copies`'s (kernels/gather.py)."""

    g: int
    slots_t: torch.Tensor
    entry: torch.Tensor
    pos: torch.Tensor
    stamp: torch.Tensor
    keep: torch.Tensor
    src_pad: torch.Tensor
    dst_pad: torch.Tensor
    copy_n: torch.Tensor


def plan_promotion(kv, g: int, ur: UnionRanks, touched: torch.Tensor, loc: torch.Tensor,
                   slots_t: torch.Tensor) -> Promotion:
    """Which staged rows of group g's round replace which touched hot entries (module docstring).
    loc [N, K, k] the round's locations (staged rows SPACE-encoded); touched [N, B_g] from
    `rank_stamps`. Nothing is written: `flush` applies it."""
    N, b = touched.shape
    KK = ur.skey.shape[1]
    base = _stamp_base(kv, loc.device)
    sloc = loc.reshape(N, KK).gather(1, ur.order)
    srank = torch.where(ur.first & (sloc >= SPACE), ur.rank, -1)
    sr, si = srank.sort(dim=1, descending=True, stable=True)
    trank = torch.where(touched, kv.hot_stamp[slots_t, g, :b] - base, BIG)
    tr, ti = trank.sort(dim=1, stable=True)
    M = min(KK, b)
    keep = sr[:, :M] > tr[:, :M]  # a prefix of each row (sr descending, tr ascending)
    si, entry = si[:, :M], ti[:, :M]
    src = (sloc.gather(1, si) - SPACE).clamp(min=0)
    dst = kv.hot_loc[slots_t].gather(1, entry)
    return Promotion(g, slots_t, entry, ur.skey.gather(1, si), base + sr[:, :M], keep,
                     torch.where(keep, src, 0).contiguous(), torch.where(keep, dst, 0).contiguous(),
                     keep.sum(1).to(torch.int32))


def flush(kv, p: Promotion, copy_layered) -> None:
    """Apply a pending promotion: every layer of group p.g copies its promoted rows from its staging
    arena to their hot-cache locations (`copy_layered(plan, src [1, nl, R, W], dst [P, nl, ps, W])`),
    then the hot-cache state names them. In stream order after the group's last attention."""
    span = kv.group_span[p.g]
    nl = span.stop - span.start
    copy_layered(p, kv.stage_arenas[:, :nl], kv.arena.latent[:, span])
    idx = _flat_index(kv, p.slots_t, p.g, p.entry, p.keep)  # the kept entries' cells (else the trash cell)
    if kv.hot_entry is not None:
        _reindex(kv, p, idx)
    kv._hot_pos_flat[idx] = p.pos
    kv._hot_stamp_flat[idx] = p.stamp
    n = p.copy_n.sum().to(torch.int64)
    kv.census.add_promoted(n, n * row_bytes(kv.stage) * nl)


def _reindex(kv, p: Promotion, idx: torch.Tensor) -> None:
    """The hot_entry index follows a promotion (before hot_pos changes; idx: the kept entries' flat
    cells, `_flat_index`): each kept entry's old position unmapped, its new one mapped to it; masked
    rows write the trailing trash cell. A promoted row was staged, so it was in no hot entry: the
    two sets of cells are disjoint."""
    G, W = kv.hot_entry.shape[1], kv.hot_entry.shape[2]
    old = kv._hot_pos_flat[idx]
    row = (p.slots_t[:, None] * G + p.g) * W
    trash = kv.hot_entry.numel()
    kv._hot_entry_flat[torch.where(p.keep & (old >= 0), row + old, trash)] = -1
    kv._hot_entry_flat[torch.where(p.keep, row + p.pos, trash)] = p.entry.to(torch.int16)


def copy_layered_torch(p: Promotion, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Plain-PyTorch `copy_layered` (the reference path, eager only: it reads the mask on the host).
    src [1, nl, R, W]; dst [P, nl, ps, W]."""
    keep = p.keep
    if not bool(keep.any()):
        return
    s, d = p.src_pad[keep], p.dst_pad[keep]
    ps = dst.shape[2]
    dst[d // ps, :, d % ps] = src[0][:, s].transpose(0, 1)  # [M, nl, W] on both sides
