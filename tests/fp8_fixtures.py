"""Shared helpers of the FP8 weight GEMM tests (tests/test_fp8_gemm.py, tests/test_fp8_modules.py)."""

from __future__ import annotations

import torch

from dhisparse.kernels import backend as kernel_backend
from dhisparse.kernels.backend import KernelSettings
from dhisparse.kernels.fp8_gemm_ref import quantize_block_fp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(128, 128), (130, 200), (64, 384), (300, 129)]  # (N, K): whole, ragged both, 3 k-blocks, ragged N/K
TILES = {"gpu": {}, "small": {"block_n": 32, "block_k": 32}, "wide": {"block_m": 32, "block_n": 128, "block_k": 64}}


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol relative to the output's largest magnitude): fp32 sums in another order; bf16 adds
    one final rounding (2^-8 relative) on either side."""
    return (1e-4, 1e-4) if dtype == torch.float32 else (2 ** -7, 2 ** -7)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    rtol, atol = _tol(want.dtype)
    scale = max(want.float().abs().max().item(), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale)


def _weight(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight with per-row magnitudes spread over 2^-4 .. 2^4, quantized on DEV."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-4, 5, (*shape[:-1], 1), generator=g).float())
    w8, s = quantize_block_fp8(w.to(DEV))
    return w8, s


def _x(T: int, K: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, K, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)

def _ids(T: int, top_k: int, E: int, pattern: str = "random", seed: int = 3) -> torch.Tensor:
    """random: distinct experts per token; all: every slot the last expert; sparse: experts 0 and E-1 only."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "all":
        ids = torch.full((T, top_k), E - 1)
    elif pattern == "sparse":
        ids = torch.where(torch.rand(T, top_k, generator=g) < 0.5, 0, E - 1)
    else:
        ids = torch.rand(T, max(E, top_k), generator=g).argsort(-1)[:, :top_k] % E
    return ids.to(DEV)


def _use(backend: str) -> None:
    kernel_backend.configure(KernelSettings(backend=backend))
