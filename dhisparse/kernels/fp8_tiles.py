"""Tiles, K splits and launch checks shared by the FP8 GEMMs (`fp8_gemm.py`: w8a16; `fp8_w8a8.py`: w8a8).

  block_m_for(rows) / tiles_for(rows, ...)   BM, then (BN, warps), from the rows one weight sees
  split_k_for(T, N, K, BM, BN, BK, device)    K splits of a decode-sized pass (fill the GPU's SMs)
  linear_launch(...) -> LinearLaunch          a linear's checked shapes, tiles and splits
  moe_align(expert_ids, E, BM)                rows sorted by expert, each run padded to BM (kernels/moe_align.py)
  moe_launch(...) -> MoeLaunch                a grouped MoE GEMM's checked shapes and tiles
  moe_grouping(expert_ids, E)                 moe_align at the BM the grouped GEMMs pick for these ids

All functions of shapes only (and the device's SM count), so a CUDA graph replays the same launch.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton

from dhisparse.kernels.fp8_gemm_ref import BLOCK, check_expert_ids, check_weight, check_x
from dhisparse.kernels.moe_align import moe_align, padded_rows  # noqa: F401  (re-exported to the GEMM modules)


def block_m_for(rows: int) -> int:
    """BM from the rows one weight sees: 16 (tl.dot's minimum) up to 16 rows, 32 up to 32, 64 up
    to LARGE_ROWS, 128 above (prefill: see `tiles_for`)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= LARGE_ROWS else 128


LARGE_ROWS = 256  # rows a weight sees above which a pass is compute-bound (prefill chunks)


def tiles_for(rows: int, block_n: int | None, num_warps: int | None) -> tuple[int, int]:
    """(BN, num_warps): 128-wide tiles on 8 warps for compute-bound passes (rows > LARGE_ROWS, BM
    128), else 64-wide tiles on 4 warps (memory-bound decode / verification). Explicit values win."""
    large = rows > LARGE_ROWS
    return block_n or (128 if large else 64), num_warps or (8 if large else 4)


def _blocks(block_n: int, block_k: int, block_m: int) -> None:
    for name, v, hi in (("block_n", block_n, BLOCK), ("block_k", block_k, BLOCK), ("block_m", block_m, 1 << 10)):
        if v < 16 or v > hi or v & (v - 1):
            raise ValueError(f"{name} must be a power of two in [16, {hi}], got {v}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _modes(x: torch.Tensor) -> dict[str, bool]:
    """IEEE: fp32 tl.dot (fp32 x, or the interpreter, whose 16-bit tl.dot is wrong); INTERP: the interpreter."""
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return {"IEEE": x.dtype == torch.float32 or interp, "INTERP": interp}


SPLIT_MAX_ROWS = 256  # passes up to this many rows split K when their tiles are too few to fill the GPU


@functools.lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
    """Two programs an SM on CUDA (enough weight reads in flight to stream HBM); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(T: int, N: int, K: int, BM: int, BN: int, BK: int, device: torch.device) -> int:
    """K splits of a pass: decode-sized passes (T <= SPLIT_MAX_ROWS) whose (m, n) tiles number
    fewer than `_programs_wanted` split K so the tiles x splits reach it (at most one split a K
    step); larger passes and CPU runs do not split. A function of the shapes only."""
    tiles = triton.cdiv(T, BM) * triton.cdiv(N, BN)
    want = _programs_wanted(device)
    if T > SPLIT_MAX_ROWS or tiles >= want:
        return 1
    return max(1, min(triton.cdiv(K, BK), triton.cdiv(want, tiles)))


class LinearLaunch(NamedTuple):
    """A linear's launch: x [T, K] @ w8 [N, K].T in tiles of bm x bn on `warps` warps, K split `split`
    ways of `kper` columns each (split / kper 0 when T or N is 0: no launch)."""
    T: int
    N: int
    K: int
    bm: int
    bn: int
    warps: int
    split: int
    kper: int


def linear_launch(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block_m: int | None, block_n: int | None,
                  block_k: int, num_warps: int | None, split_k: int | None) -> LinearLaunch:
    """Checks x / w8 / scale (errors name the parameter) and picks the tiles (`block_m_for`, `tiles_for`) and
    K splits (`split_k_for` unless split_k; no empty split) of a linear; the w8a16 and w8a8 kernels share it."""
    check_weight(w8, scale, stacked=False)
    check_x(x, w8)
    T, (N, K) = x.shape[0], w8.shape
    bm = block_m or block_m_for(T)
    bn, warps = tiles_for(T, block_n, num_warps)
    _blocks(bn, block_k, bm)
    if T == 0 or N == 0:
        return LinearLaunch(T, N, K, bm, bn, warps, 0, 0)
    split = split_k or split_k_for(T, N, K, bm, bn, block_k, x.device)
    kper = triton.cdiv(triton.cdiv(K, block_k), split) * block_k
    return LinearLaunch(T, N, K, bm, bn, warps, triton.cdiv(K, kper), kper)


def rows_per_expert(M: int, E: int) -> int:
    """The rows an expert sees on average when M (token, slot) rows spread over E experts."""
    return triton.cdiv(M, max(E, 1))


def moe_block_m(M: int, E: int) -> int:
    """A grouped GEMM's default BM for M rows over E experts (`moe_launch`, `moe_grouping`)."""
    return block_m_for(rows_per_expert(M, E))


class MoeLaunch(NamedTuple):
    """A grouped MoE GEMM's launch: T tokens x top_k slots (M rows) over E experts of w8 [E, N, K], tiles
    bm x bn on `warps` warps."""
    E: int
    N: int
    K: int
    T: int
    top_k: int
    M: int
    bm: int
    bn: int
    warps: int


def moe_launch(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor, block_m: int | None,
               block_n: int | None, block_k: int, num_warps: int | None) -> MoeLaunch:
    """Checks the grouped GEMM's inputs (ids by value only off CUDA: that would sync) and picks its tiles
    from the rows an expert sees on average; the w8a16 and w8a8 kernels share it."""
    check_weight(w8, scale, stacked=True)
    check_x(x, w8)
    E, N, K = w8.shape
    check_expert_ids(expert_ids, x.shape[0], E, values=not expert_ids.is_cuda)
    T, top_k = expert_ids.shape
    bm = block_m or moe_block_m(T * top_k, E)
    bn, warps = tiles_for(rows_per_expert(T * top_k, E), block_n, num_warps)
    _blocks(bn, block_k, bm)
    return MoeLaunch(E, N, K, T, top_k, T * top_k, bm, bn, warps)


def moe_grouping(expert_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align(expert_ids, E, BM)` at the BM a grouped GEMM picks for these ids by default (`moe_launch`):
    a MoE layer's gate-up and down GEMMs (ids [T, top_k] and [T * top_k, 1]: the same flat rows) share it."""
    return moe_align(expert_ids, E, moe_block_m(expert_ids.numel(), E))


def checked_grouping(grouping: tuple[torch.Tensor, torch.Tensor], M: int, E: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouping` (sorted_rows, block_expert) if its sizes are moe_align's for M rows, E experts and BM; else
    ValueError naming grouping (made for other ids or another block_m)."""
    rows, block_expert = grouping
    P = padded_rows(M, E, BM)
    if rows.numel() != P or block_expert.numel() != P // BM:
        raise ValueError(f"grouping was made for other rows or another block_m: {rows.numel()} sorted rows and "
                         f"{block_expert.numel()} blocks, want {P} and {P // BM} (M {M}, E {E}, BM {BM})")
    return rows, block_expert
