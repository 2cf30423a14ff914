"""Block-scaled FP8 weights in plain PyTorch: quantization and the references of the FP8 GEMMs.

A weight W [N, K] is stored as it is in FP8 checkpoints of GLM-5 / DeepSeek-V3: `w8`
float8_e4m3fn [N, K] plus `scale` fp32 [ceil(N/128), ceil(K/128)] (a checkpoint's "scale_inv"),
and the real weight is w8.float() * scale[n // 128, k // 128]. Stacked experts are w8 [E, N, K],
scale [E, ceil(N/128), ceil(K/128)]. The last blocks of a ragged N or K are partial.

  quantize_block_fp8(w [..., N, K])               -> (w8 [..., N, K], scale [..., nb, kb])
  dequantize_block_fp8(w8, scale)                 -> fp32 [..., N, K]
  fp8_linear_reference(x [T, K], w8 [N, K], scale) -> [T, N]           (x's dtype)
  fp8_moe_reference(x [T, K], w8 [E, N, K], scale [E, nb, kb], expert_ids [T, top_k])
                                                  -> [T, top_k, N]     (x's dtype)

The GEMMs do fp32 math on the dequantized weight and cast once at the end; the Triton kernels of
`fp8_gemm.py` compute the same sums in another order. Every function validates its inputs and
raises ValueError naming the offending parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # the checkpoints' scale block, both dimensions
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations the GEMMs take


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """Scale blocks (ceil(n/128), ceil(k/128)) of an [n, k] weight."""
    return -(-n // BLOCK), -(-k // BLOCK)


def _check_scale(w8: torch.Tensor, scale: torch.Tensor) -> None:
    """scale fp32 [..., ceil(N/128), ceil(K/128)] for w8 [..., N, K], on w8's device."""
    want = (*w8.shape[:-2], *scale_shape(*w8.shape[-2:]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"scale must be float32 {want} for w8 {tuple(w8.shape)}, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if scale.device != w8.device:
        raise ValueError(f"scale is on {scale.device}, w8 on {w8.device}")


def check_weight(w8: torch.Tensor, scale: torch.Tensor, stacked: bool) -> None:
    """w8 float8_e4m3fn [N, K] ([E, N, K] when stacked), scale fp32 of the matching block shape."""
    dims = 3 if stacked else 2
    if w8.dtype != FP8:
        raise ValueError(f"w8 must be float8_e4m3fn, got {w8.dtype}")
    if w8.dim() != dims:
        raise ValueError(f"w8 must have {dims} dims ({'[E, N, K]' if stacked else '[N, K]'}), got {tuple(w8.shape)}")
    _check_scale(w8, scale)


def check_x(x: torch.Tensor, w8: torch.Tensor) -> None:
    """x [T, K] fp32 / bf16 / fp16, K = w8's last dim, on w8's device."""
    if x.dtype not in ACT_DTYPES or x.dim() != 2:
        raise ValueError(f"x must be a float32 / bfloat16 / float16 [T, K] tensor, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != w8.shape[-1]:
        raise ValueError(f"x has K = {x.shape[1]}, w8 has K = {w8.shape[-1]}")
    if x.device != w8.device:
        raise ValueError(f"x is on {x.device}, w8 on {w8.device}")


def check_expert_ids(expert_ids: torch.Tensor, T: int, E: int, values: bool = True) -> None:
    """expert_ids int64 [T, top_k]; with `values`, every id in [0, E) (a host sync)."""
    if expert_ids.dtype != torch.int64 or expert_ids.dim() != 2 or expert_ids.shape[0] != T:
        raise ValueError(f"expert_ids must be int64 [T={T}, top_k], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if values and expert_ids.numel() and not bool(((expert_ids >= 0) & (expert_ids < E)).all()):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        raise ValueError(f"expert_ids must lie in [0, {E}), got min {lo} max {hi}")


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[..., N, K] zero-padded to whole blocks and viewed [..., nb, 128, kb, 128]."""
    n, k = t.shape[-2:]
    nb, kb = scale_shape(n, k)
    t = F.pad(t, (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    return t.reshape(*t.shape[:-2], nb, BLOCK, kb, BLOCK)


def _expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """scale [..., nb, kb] -> [..., n, k]: each block's scale over its elements."""
    return scale.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]


def quantize_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] floating -> (w8 float8_e4m3fn [..., N, K], scale fp32 [..., ceil(N/128), ceil(K/128)]).

    scale = amax / 448 per 128x128 block (partial edge blocks count only their real elements), so a
    block's largest magnitude maps to e4m3's largest finite value; an all-zero block gets scale 1.0
    (its w8 is zero, and dequantizes to exactly zero). w8 = w / scale rounded to nearest."""
    if not w.is_floating_point() or w.dtype == FP8 or w.dim() < 2:
        raise ValueError(f"w must be a floating [..., N, K] tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape[-2:]
    amax = _blocks(w.float()).abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / _expand(scale, n, k)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8), scale.contiguous()


def dequantize_block_fp8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(w8 float8_e4m3fn [..., N, K], scale fp32 [..., nb, kb]) -> fp32 [..., N, K]."""
    if w8.dtype != FP8 or w8.dim() < 2:
        raise ValueError(f"w8 must be a float8_e4m3fn [..., N, K] tensor, got {w8.dtype} {tuple(w8.shape)}")
    _check_scale(w8, scale)
    n, k = w8.shape[-2:]
    return w8.float() * _expand(scale, n, k)


def fp8_linear_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] (bf16 / fp32 / fp16) @ W.T -> [T, N] in x's dtype (fp32 math, one cast at the end)."""
    check_weight(w8, scale, stacked=False)
    check_x(x, w8)
    return (x.float() @ dequantize_block_fp8(w8, scale).T).to(x.dtype)


def fp8_moe_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, K], stacked w8 [E, N, K] / scale [E, nb, kb], expert_ids int64 [T, top_k] in [0, E)
    -> [T, top_k, N] in x's dtype: row (t, j) = x[t] @ W[expert_ids[t, j]].T in fp32, cast at the end."""
    check_weight(w8, scale, stacked=True)
    check_x(x, w8)
    E, N = w8.shape[:2]
    check_expert_ids(expert_ids, x.shape[0], E)
    T, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    tok = torch.arange(T * top_k, device=x.device) // max(top_k, 1)
    out = torch.zeros(T * top_k, N, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(E):
        rows = (flat == e).nonzero().squeeze(1)
        if rows.numel():
            out[rows] = xf[tok[rows]] @ dequantize_block_fp8(w8[e], scale[e]).T
    return out.to(x.dtype).reshape(T, top_k, N)


# ---- dynamic activation quantization ("w8a8"): DeepSeek-V3 / GLM-5 FP8 checkpoints' activation_scheme "dynamic" ----
#
#   quantize_act_fp8(x [T, K])            -> (x8 float8_e4m3fn [T, K], xs fp32 [T, ceil(K/128)])
#   dequantize_act_fp8(x8, xs)            -> fp32 [T, K]
#   fp8_linear_w8a8_reference(x, w8, scale)            -> [T, N]         (x's dtype)
#   fp8_moe_w8a8_reference(x, w8, scale, expert_ids)   -> [T, top_k, N]  (x's dtype)
#
# Each token's row is quantized in groups of 128 columns (1 x 128, as SGLang / vLLM serve these checkpoints:
# per-token-group quantization), so both GEMM operands are FP8 and each k-block's partial product is scaled by
# the token's group scale times the weight's block scale.

FP8_ACTIVATIONS = ("none", "dynamic")  # activations kept in their dtype (w8a16) / FP8 per token group (w8a8)


def check_activations(activations: str) -> None:
    """ValueError naming `activations` unless it is one of FP8_ACTIVATIONS."""
    if activations not in FP8_ACTIVATIONS:
        raise ValueError(f"activations must be one of {FP8_ACTIVATIONS}, got {activations!r}")


def check_act(x: torch.Tensor) -> None:
    """ValueError naming x unless it is a floating, non-FP8 [T, K] tensor (what the activation quantizers take)."""
    if not x.is_floating_point() or x.dtype == FP8 or x.dim() != 2:
        raise ValueError(f"x must be a floating [T, K] tensor, got {x.dtype} {tuple(x.shape)}")


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] floating -> (x8 float8_e4m3fn [T, K], xs fp32 [T, ceil(K/128)]): per token and group of 128
    columns, scale = amax / 448 (an all-zero group: 1.0, its x8 zero), x8 = x / scale rounded to nearest
    (fp32 division), the weights' rule (`quantize_block_fp8`) on 1 x 128 blocks."""
    check_act(x)
    T, k = x.shape
    kb = -(-k // BLOCK)
    g = F.pad(x.float(), (0, kb * BLOCK - k)).reshape(T, kb, BLOCK)
    amax = g.abs().amax(dim=-1)  # [T, kb]
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal, which can
    # differ in the last bit from the rounded quotient the kernels compute (session 44's H100 run)
    xs = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = (g / xs[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(T, kb * BLOCK)[:, :k]
    return q.to(FP8), xs.contiguous()


def dequantize_act_fp8(x8: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """(x8 float8_e4m3fn [T, K], xs fp32 [T, ceil(K/128)]) -> fp32 [T, K]."""
    if x8.dtype != FP8 or x8.dim() != 2:
        raise ValueError(f"x8 must be a float8_e4m3fn [T, K] tensor, got {x8.dtype} {tuple(x8.shape)}")
    want = (x8.shape[0], -(-x8.shape[1] // BLOCK))
    if xs.dtype != torch.float32 or tuple(xs.shape) != want:
        raise ValueError(f"xs must be float32 {want} for x8 {tuple(x8.shape)}, got {xs.dtype} {tuple(xs.shape)}")
    return x8.float() * xs.repeat_interleave(BLOCK, -1)[:, : x8.shape[1]]


def _act_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> fp32 [T, K]: x as the w8a8 GEMMs read it (quantized per token group, dequantized)."""
    return dequantize_act_fp8(*quantize_act_fp8(x))


def fp8_linear_w8a8_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear_reference` with x quantized per token group first (`quantize_act_fp8`): fp32 math on both
    dequantized operands, one cast to x's dtype at the end."""
    check_weight(w8, scale, stacked=False)
    check_x(x, w8)
    return fp8_linear_reference(_act_round_trip(x), w8, scale).to(x.dtype)


def fp8_moe_w8a8_reference(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                           expert_ids: torch.Tensor) -> torch.Tensor:
    """`fp8_moe_reference` with x quantized per token group first (each token once, whatever its experts)."""
    check_weight(w8, scale, stacked=True)
    check_x(x, w8)
    return fp8_moe_reference(_act_round_trip(x), w8, scale, expert_ids).to(x.dtype)
