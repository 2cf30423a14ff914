"""Top-k with a fixed tie rule, for the sparse indexers' selections.

`torch.topk` breaks ties among equal scores by whatever its kernel does, and that depends on the
row's width and the device: the lightning indexer's scores are sums of ReLUs, so exact-zero ties
are common (every head's logit negative), and a history row shorter or longer in the batch (the
score tensor is [T, Lmax] over the batch) could pick different tied positions. The selection would
then depend on which requests share a pass - a speculative round and a decode step of the same
request could attend to different rows. `stable_topk` picks, among equal scores, the lowest
positions, and orders the k picks by (score descending, position ascending), so a selection is a
function of the request's own scores only.

Cost: two top-k passes over the row (the second finds the lowest tied positions) and two sorts of
k entries, against one top-k. `packed_topk` gives the same result with one top-k over int64 keys
(the score's order-preserving bits above, the position's complement below: no two keys tie), so the
tie rule costs a key pass instead of a second top-k and two sorts, and `lean_topk` keeps the two
top-k passes but sorts once. On an H100 at 100K keys, k 2,048 (bench/results/topk_bench_s46_h100.json)
packed is 0.65x of stable at 20 rows and 0.85x at 47 but 1.09x at 100, lean 0.91-0.97x throughout;
`auto_topk`, the indexers' default, takes packed for a decode-sized pass and lean above it.
"""

from __future__ import annotations

import torch

# the forms `{form}_topk` of this module; the indexers' choice is KernelSettings.indexer_topk
TOPK_FORMS = ("stable", "packed", "lean", "auto")
AUTO_PACKED_ROWS = 64  # auto: packed_topk up to this many score rows on CUDA, lean_topk above


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., L], 0 <= k <= L -> (values, indices) [..., k]: the k largest scores, ties at
    the boundary taken by lowest index, ordered by value descending then index ascending."""
    if k == 0 or scores.numel() == 0:
        return scores.new_empty(*scores.shape[:-1], k), torch.empty(*scores.shape[:-1], k, dtype=torch.int64,
                                                                    device=scores.device)
    val, idx = torch.topk(scores, k, dim=-1)  # the function: tests patch the method for their references
    kth = val[..., -1:]
    above = (val > kth).sum(-1, keepdim=True)  # entries strictly above the boundary: all of them are in
    low = _lowest_tied(scores, kth, k)
    j = torch.arange(k, device=scores.device)
    from_tie = j >= above
    picked = torch.where(from_tie, low.gather(-1, (j - above).clamp(min=0)), idx)
    picked_val = scores.gather(-1, picked)
    by_pos = picked.sort(dim=-1).indices  # order: index ascending, then a stable sort by value descending
    picked, picked_val = picked.gather(-1, by_pos), picked_val.gather(-1, by_pos)
    by_val = picked_val.sort(dim=-1, descending=True, stable=True).indices
    return picked_val.gather(-1, by_val), picked.gather(-1, by_val)


def _lowest_tied(scores: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] int64: the k lowest positions whose score equals the row's boundary value kth [..., 1],
    ascending (past the tied ones: garbage from -inf, never gathered by the callers)."""
    pos = torch.arange(scores.shape[-1], device=scores.device)
    tied = torch.where(scores == kth, -pos.to(torch.float32), float("-inf"))  # exact for positions < 2^24
    return (-torch.topk(tied, k, dim=-1).values).to(torch.int64)


def _packed(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys sortable_bits(values) << 32 | (2^32 - 1 - index): descending order is (value
    descending, index ascending), and no two keys of distinct indices tie."""
    return (sortable_bits(values).to(torch.int64) << 32) | (0xFFFFFFFF - index)


def sortable_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 x -> int32 with the same order (signed compare): non-negative floats keep their bits,
    negative ones flip their magnitude bits. -0.0 is made +0.0 first (they are equal scores, and a
    sum of w * relu(.) terms with w < 0 gives -0.0); NaN is not expected (indexer scores)."""
    b = (x.to(torch.float32) + 0.0).view(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def packed_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`stable_topk` through one top-k: key = sortable_bits(score) << 32 | (2^32 - 1 - index), int64
    [..., L] (L < 2^31), whose descending order is (score descending, index ascending) with no ties;
    the k largest keys, sorted, are the picks in order. Same (values, indices) as `stable_topk`."""
    L = scores.shape[-1]
    if k == 0 or scores.numel() == 0:
        return stable_topk(scores, k)
    key = _packed(scores, torch.arange(L, device=scores.device, dtype=torch.int64))
    idx = 0xFFFFFFFF - (torch.topk(key, k, dim=-1).values & 0xFFFFFFFF)
    return scores.gather(-1, idx), idx


def lean_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`stable_topk` with two fewer sorts: the first top-k unsorted (its k-th value is the minimum of
    the k; the picks' order is fixed at the end anyway), the boundary's tied slots refilled from the
    lowest tied positions by their rank among the tied slots, and one sort of packed (score, index)
    keys for the order instead of a sort by index then a stable one by value. Same (values, indices)."""
    if k == 0 or scores.numel() == 0:
        return stable_topk(scores, k)
    val, idx = torch.topk(scores, k, dim=-1, sorted=False)
    kth = val.amin(-1, keepdim=True)
    low = _lowest_tied(scores, kth, k)
    at_kth = val == kth
    rank = (at_kth.cumsum(-1) - 1).clamp(min=0)
    picked = torch.where(at_kth, low.gather(-1, rank), idx)
    picked_val = scores.gather(-1, picked)
    order = _packed(picked_val, picked).argsort(dim=-1, descending=True)
    return picked_val.gather(-1, order), picked.gather(-1, order)


def auto_form(rows: int, device_type: str) -> str:
    """The form `auto_topk` takes for `rows` score rows on a device: on CUDA "packed" up to
    AUTO_PACKED_ROWS rows (a decode pass: one row a request) and "lean" above (a verification
    round's rows; packed's int64 top-k grows past stable's there); "stable" on the CPU, where the
    others were not faster (packed 1.35x at 100K, session 36)."""
    if device_type != "cuda":
        return "stable"
    return "packed" if rows <= AUTO_PACKED_ROWS else "lean"


def auto_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`stable_topk`'s (values, indices) through the form `auto_form` names for scores [..., L]."""
    form = auto_form(scores.numel() // max(scores.shape[-1], 1), scores.device.type)
    if form == "packed":
        return packed_topk(scores, k)
    return lean_topk(scores, k) if form == "lean" else stable_topk(scores, k)
