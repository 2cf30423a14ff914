"""Dispatchers of the block-scaled FP8 GEMMs: `fp8_gemm.py`'s Triton kernels where
`kernels/backend.py` says so, the references of `fp8_gemm_ref.py` (same signatures) otherwise.

  fp8_linear(x [T, K], w8 [N, K], scale [nb, kb])                        -> [T, N]
  fp8_moe(x [T, K], w8 [E, N, K], scale [E, nb, kb], expert_ids [T, top_k]) -> [T, top_k, N]

Triton is optional on CPU, as in `dispatch.py`: without it every call runs the reference (backend
"triton" then fails with a clear error).
"""

from __future__ import annotations

import torch

from dhisparse.kernels.backend import use_triton
from dhisparse.kernels.fp8_gemm_ref import fp8_linear_reference, fp8_moe_reference

try:
    from dhisparse.kernels import fp8_gemm as _fp8_triton
except ImportError:  # no Triton on this machine
    _fp8_triton = None


def _triton_for(t: torch.Tensor) -> bool:
    if not use_triton(t):
        return False
    if _fp8_triton is None:
        raise ValueError("kernel_backend 'triton' needs the triton package; install it or use kernel_backend 'torch'")
    return True


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ W.T -> [T, N] in x's dtype, W = w8 float8_e4m3fn [N, K] x block scales [nb, kb]."""
    if _triton_for(x):
        return _fp8_triton.fp8_linear_triton(x, w8, scale)
    return fp8_linear_reference(x, w8, scale)


def fp8_moe(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Row (t, j) = x[t] @ W[expert_ids[t, j]].T -> [T, top_k, N] in x's dtype; w8 [E, N, K], scale [E, nb, kb]."""
    if _triton_for(x):
        return _fp8_triton.fp8_moe_triton(x, w8, scale, expert_ids)
    return fp8_moe_reference(x, w8, scale, expert_ids)
