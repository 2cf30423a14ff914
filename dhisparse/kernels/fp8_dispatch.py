"""Dispatchers of the block-scaled FP8 GEMMs: `fp8_gemm.py`'s Triton kernels where
`kernels/backend.py` says so, the references of `fp8_gemm_ref.py` (same signatures) otherwise.

  fp8_linear(x [T, K], w8 [N, K], scale [nb, kb])                        -> [T, N]
  fp8_moe(x [T, K], w8 [E, N, K], scale [E, nb, kb], expert_ids [T, top_k]) -> [T, top_k, N]

Triton is optional on CPU, as in `dispatch.py`: without it every call runs the reference (backend
"triton" then fails with a clear error).

A linear of at least DEQUANT_ROWS rows in a 16-bit dtype (a prefill chunk: compute-bound) takes
its weight dequantized to that dtype by one Triton pass and multiplies with torch (cuBLAS): on the
H200 our FP8 GEMM reaches 0.3-0.4x bf16 matmul's FLOP rate there (bench/results/fp8_gemm_bench_s28c_h200.json)
and dequantizing costs one read and one write of the weight. The product then rounds each
dequantized weight to 16 bits once (the kernels keep the scale in fp32).

activations (FP8_ACTIVATIONS): "none" keeps the activations in their dtype (w8a16: `fp8_gemm.py`);
"dynamic" quantizes each token's row per group of 128 columns first and multiplies FP8 by FP8 (w8a8:
`fp8_w8a8.py`), as the FP8 checkpoints' activation_scheme "dynamic" is served. A dynamic prefill-sized
linear multiplies the dequantized weight by the round-tripped activations (`fp8_act_round_trip_triton`).
Inside `shared_activations(x)` GEMMs reading x quantize it once (a layer's q_a and kv_a, a
MoE's routed gate-up and shared gate and up).
"""

from __future__ import annotations

import contextlib

import torch

from dhisparse.kernels.backend import use_triton
from dhisparse.kernels.fp8_gemm_ref import (FP8_ACTIVATIONS, check_activations, check_x, fp8_linear_reference,  # noqa: F401
                                            fp8_linear_w8a8_reference, fp8_moe_reference, fp8_moe_w8a8_reference)

try:
    from dhisparse.kernels import fp8_gemm as _fp8_triton
    from dhisparse.kernels import fp8_w8a8 as _w8a8_triton
except ImportError:  # no Triton on this machine
    _fp8_triton = _w8a8_triton = None


def _triton_for(t: torch.Tensor) -> bool:
    if not use_triton(t):
        return False
    if _fp8_triton is None:
        raise ValueError("kernel_backend 'triton' needs the triton package; install it or use kernel_backend 'torch'")
    return True


DEQUANT_ROWS = 2048  # rows from which a 16-bit linear dequantizes its weight and runs torch.matmul


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, expert: bool = False,
               activations: str = "none") -> torch.Tensor:
    """x [T, K] @ W.T -> [T, N] in x's dtype, W = w8 float8_e4m3fn [N, K] x block scales [nb, kb].
    expert: a shared expert's GEMM (the Triton path launches it under the experts' kernel name).
    activations: "none" / "dynamic" (module docstring)."""
    check_activations(activations)
    dynamic = activations == "dynamic"
    if _triton_for(x):
        if x.shape[0] >= DEQUANT_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            check_x(x, w8)
            if dynamic:
                x = _w8a8_triton.fp8_act_round_trip_triton(x)
            return torch.nn.functional.linear(x, _fp8_triton.fp8_dequantize_triton(w8, scale, x.dtype))
        if dynamic:
            return _w8a8_triton.fp8_w8a8_linear_triton(x, w8, scale, expert=expert)
        return _fp8_triton.fp8_linear_triton(x, w8, scale, expert=expert)
    return (fp8_linear_w8a8_reference if dynamic else fp8_linear_reference)(x, w8, scale)


def shared_activations(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """A scope in which "dynamic" GEMMs on the Triton path that read x quantize it once
    (`fp8_w8a8.shared_activations`); the references quantize per call (the same values either way). A
    no-op without Triton."""
    return _w8a8_triton.shared_activations(x) if _w8a8_triton is not None else contextlib.nullcontext()


def fp8_moe_grouping(x: torch.Tensor, expert_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton grouped GEMMs' row grouping of `expert_ids` (`fp8_tiles.moe_grouping`) where x takes the
    Triton path, else None: computed once, it serves a MoE layer's gate-up and down GEMMs (`fp8_moe`'s grouping)."""
    return _fp8_triton.moe_grouping(expert_ids, n_experts) if _triton_for(x) else None


def fp8_moe(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor,
            activations: str = "none", grouping=None) -> torch.Tensor:
    """Row (t, j) = x[t] @ W[expert_ids[t, j]].T -> [T, top_k, N] in x's dtype; w8 [E, N, K], scale [E, nb, kb].
    activations: "none" / "dynamic" (module docstring). grouping: `fp8_moe_grouping` of the same flat ids
    (None: the Triton path groups them itself; the reference needs none)."""
    check_activations(activations)
    dynamic = activations == "dynamic"
    if _triton_for(x):
        fn = _w8a8_triton.fp8_w8a8_moe_triton if dynamic else _fp8_triton.fp8_moe_triton
        return fn(x, w8, scale, expert_ids, grouping=grouping)
    return (fp8_moe_w8a8_reference if dynamic else fp8_moe_reference)(x, w8, scale, expert_ids)
