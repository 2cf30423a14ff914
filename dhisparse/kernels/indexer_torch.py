"""Batched lightning-indexer scoring in plain PyTorch: every token of a pass against its request's
paged index keys in one chunked gather, no per-request Python loop. The CPU path, and the reference
of the Triton kernel in `kernels/indexer.py` (same signatures)."""

from __future__ import annotations

import torch

import dhisparse.core.topk as topk_forms
from dhisparse.core.rows import gather_rows
from dhisparse.core.batch import IndexTable
from dhisparse.kernels.backend import settings

SCORE_ELEMS = 1 << 27  # fp32 scores [chunk, Lmax] materialised per Triton launch (512 MiB)
GATHER_ELEMS = 1 << 24  # elements of gathered keys / logits per chunk of the torch path


def indexer_scores_torch(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                         table: IndexTable, chunk_elems: int = GATHER_ELEMS) -> torch.Tensor:
    """Plain-PyTorch twin of `indexer_scores_triton`: same inputs, scores [T, Lmax] fp32. Keys
    stored in `table.fmt` are decoded to the model dtype first (FP8: e4m3 * scale)."""
    T, H, D = q.shape
    rows, locs, lens, fmt, scales = table
    Lmax = locs.shape[1]
    out = torch.full((T, Lmax), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or Lmax == 0 or rows.numel() == 0:
        return out
    scale = D**-0.5
    s_idx = torch.arange(Lmax, device=q.device)
    step = max(1, chunk_elems // (Lmax * max(D, H)))
    for a in range(0, T, step):
        b = min(T, a + step)
        r = req_idx[a:b]
        lc = locs[r]  # [S, Lmax]
        vis = (s_idx[None, :] < torch.minimum(lens[r], positions[a:b] + 1)[:, None]) & (lc >= 0)
        keys = gather_rows(rows, lc.clamp(min=0))  # [S, Lmax, Wi] (split FP8 keys: values [.., D], then scales)
        if scales is not None:
            keys = torch.cat([keys, gather_rows(scales, lc.clamp(min=0))], dim=-1)
        keys = (fmt.decode(keys) if fmt is not None else keys).float()  # [S, Lmax, iD]
        logit = torch.relu(torch.matmul(q[a:b].float(), keys.transpose(1, 2)) * scale)  # [S, iH, Lmax]
        score = torch.matmul(w[a:b].float().unsqueeze(-2), logit).squeeze(-2)  # [S, Lmax]
        out[a:b] = score.masked_fill(~vis, float("-inf"))
    return out


def tie_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexers' tie-ruled top-k (values, indices) in the form `KernelSettings.indexer_topk` names
    (`core/topk.py`'s `{form}_topk`, looked up when called; every form selects the same rows)."""
    return getattr(topk_forms, f"{settings().indexer_topk}_topk")(scores, k)


def topk_of_scores(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, L] (-inf = not visible) -> ordered selection [T, topk] int64, -1 padding; ties
    by lowest position (core/topk.py), so a selection never depends on the batch's Lmax."""
    T, L = scores.shape
    kk = min(topk, L)
    if T > 0 and kk == topk:  # the usual long-history case: no padding
        val, idx = tie_topk(scores, kk)
        return idx.masked_fill_(torch.isinf(val), -1)
    out = torch.full((T, topk), -1, dtype=torch.int64, device=scores.device)
    if T == 0 or kk == 0:
        return out
    val, idx = tie_topk(scores, kk)
    out[:, :kk] = idx.masked_fill_(torch.isinf(val), -1)
    return out


def topk_in_chunks(score_fn, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                   table: IndexTable, topk: int, group: int = 1) -> torch.Tensor:
    """Selection [T, topk] int64 of every token, scoring tokens in chunks with `score_fn` (a
    scores function of this module's signature) so that at most SCORE_ELEMS fp32 scores are live.
    Chunks hold whole groups of `group` tokens."""
    T, Lmax = q.shape[0], table.locs.shape[1]
    step = max(group, SCORE_ELEMS // max(Lmax, 1) // group * group)
    if T <= step:  # one chunk (every decode / verification pass): no output buffer to fill and copy
        return topk_of_scores(score_fn(q, w, positions, req_idx, table), topk)
    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    for a in range(0, T, step):
        b = min(T, a + step)
        out[a:b] = topk_of_scores(score_fn(q[a:b], w[a:b], positions[a:b], req_idx[a:b], table), topk)
    return out


def indexer_topk_torch(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                       table: IndexTable, topk: int) -> torch.Tensor:
    """Same result as `indexer_topk_triton`, plain PyTorch (the CPU path and the kernel's reference)."""
    return topk_in_chunks(indexer_scores_torch, q, w, positions, req_idx, table, topk)
