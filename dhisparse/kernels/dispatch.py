"""Dispatchers the layers call: the Triton kernel where `kernels/backend.py` says so, the
plain-PyTorch reference of the same signature otherwise.

Triton is optional on CPU: when it is not installed the Triton modules are not imported and
every dispatcher runs its reference (backend "triton" then fails with a clear error).
"""

from __future__ import annotations

import torch

from dhisparse.core.batch import IndexTable
from dhisparse.core.kvformat import RowFormat
from dhisparse.kernels.backend import settings, use_triton
from dhisparse.kernels.indexer_torch import indexer_topk_torch
from dhisparse.kernels.sparse_mla_ref import sparse_mla_reference

try:
    from dhisparse.kernels import indexer as _indexer_triton
    from dhisparse.kernels import sparse_mla as _sparse_mla_triton
except ImportError:  # no Triton on this machine
    _indexer_triton = _sparse_mla_triton = None


def _triton_for(t: torch.Tensor, module) -> bool:
    if not use_triton(t):
        return False
    if module is None:
        raise ValueError("kernel_backend 'triton' needs the triton package; install it or use kernel_backend 'torch'")
    return True


def sparse_mla(q_abs: torch.Tensor, q_pe: torch.Tensor, rows, loc: torch.Tensor, scale: float,
               fmt: RowFormat | None = None) -> torch.Tensor:
    """Sparse latent attention; contract of `sparse_mla_reference` (q_abs [T, H, C], q_pe [T, H, R],
    rows: a row space or a tuple of two, stored in `fmt` (None: plain), loc [T, k] -> [T, H, C])."""
    if _triton_for(q_abs, _sparse_mla_triton):
        return _sparse_mla_triton.sparse_mla_triton(q_abs, q_pe, rows, loc, scale, fmt)
    return sparse_mla_reference(q_abs, q_pe, rows, loc, scale, fmt=fmt)


def indexer_topk_batched(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                         table: IndexTable, topk: int, tokens_per_request: int) -> torch.Tensor:
    """Ordered top-k selection [T, topk] over every request's index keys at once (contract of
    `indexer_topk_torch`). tokens_per_request: K when every request runs K tokens (grouped
    verification scoring when `KernelSettings.indexer_group`), else 0."""
    if _triton_for(q, _indexer_triton):
        group = max(1, tokens_per_request) if settings().indexer_group else 1
        return _indexer_triton.indexer_topk_triton(q, w, positions, req_idx, table, topk, group=group)
    return indexer_topk_torch(q, w, positions, req_idx, table, topk)
