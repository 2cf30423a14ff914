"""Linear layers and routed experts over block-scaled FP8 weights, stored as FP8 checkpoints of
GLM-5 / DeepSeek-V3 store them: float8_e4m3fn weights plus fp32 "scale_inv" buffers of one scale
per 128x128 block (`kernels/fp8_gemm_ref.py`). The GEMMs run through `kernels/fp8_dispatch.py`.

  Fp8Linear:  weight [out, in], weight_scale_inv [ceil(out/128), ceil(in/128)]; x [..., in] -> [..., out]
  Fp8Experts: gate_up_proj [E, 2I, H] (gate first) + gate_up_proj_scale_inv [E, ceil(2I/128), ceil(H/128)],
              down_proj [E, H, I] + down_proj_scale_inv [E, ceil(H/128), ceil(I/128)]; x [T, H] -> [T, H];
              `each_row` (row i through one expert) is what an expert-parallel owner runs (layers/ep_moe.py)

Both take `activations` ("none": the activations stay in their dtype, w8a16; "dynamic": FP8 per token and
group of 128 columns, w8a8, as the FP8 checkpoints' activation_scheme "dynamic" is served;
kernels/fp8_dispatch.py); `set_fp8_activations` sets it on every FP8 module of a model, and
`resolve_fp8_activations` resolves the engine's "auto" from the checkpoint's activation_scheme first.

Fp8Experts keeps `layers/moe.py`'s stacked layout; its scale blocks tile the stacked [2I, H]
matrix, so a checkpoint's separate gate / up scales stack into it when I is a multiple of 128.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dhisparse.kernels.fp8_dispatch import check_activations, fp8_linear, fp8_moe, fp8_moe_grouping
from dhisparse.kernels.fp8_gemm_ref import FP8, quantize_block_fp8, scale_shape
from dhisparse.layers.moe import Experts, Routing


def _fp8_buffers(module: nn.Module, name: str, shape: tuple[int, ...], device=None) -> None:
    """Register `name` float8_e4m3fn [..., N, K] (zeros) and `name`_scale_inv fp32 [..., nb, kb] (ones)."""
    module.register_buffer(name, torch.zeros(shape, dtype=FP8, device=device))
    blocks = (*shape[:-2], *scale_shape(*shape[-2:]))
    module.register_buffer(f"{name}_scale_inv", torch.ones(blocks, dtype=torch.float32, device=device))


def _load_quantized(module: nn.Module, name: str, w: torch.Tensor) -> None:
    """Quantize `w` into the buffers `name` and `name`_scale_inv."""
    w8, scale = quantize_block_fp8(w.detach())
    getattr(module, name).copy_(w8)
    getattr(module, f"{name}_scale_inv").copy_(scale)


class Fp8Linear(nn.Module):
    """y = x @ W.T, W = weight [out, in] (fp8) x weight_scale_inv blocks; no bias. expert: a shared
    expert's projection (the same GEMM, launched under the experts' kernel name for profiles)."""

    def __init__(self, in_features: int, out_features: int, device=None, expert: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.expert = in_features, out_features, expert
        self.activations = "none"  # `set_fp8_activations`
        _fp8_buffers(self, "weight", (out_features, in_features), device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        y = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv, expert=self.expert,
                       activations=self.activations)
        return y.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, lin: nn.Linear, expert: bool = False) -> "Fp8Linear":
        """`lin`'s weight (bf16 / fp32) quantized to 128x128-block FP8, on its device."""
        if lin.bias is not None:
            raise ValueError("lin has a bias; Fp8Linear has none")
        m = cls(lin.in_features, lin.out_features, device=lin.weight.device, expert=expert)
        _load_quantized(m, "weight", lin.weight)
        return m

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128 blocks"
                + (", shared expert" if self.expert else "") + f", activations={self.activations}")


class Fp8Experts(nn.Module):
    """`layers.moe.Experts` over FP8 weights: every routed (token, slot) row through the grouped GEMMs."""

    def __init__(self, E: int, hidden: int, inter: int, device=None) -> None:
        super().__init__()
        self.n_experts, self.hidden, self.inter = E, hidden, inter
        self.activations = "none"  # `set_fp8_activations`
        _fp8_buffers(self, "gate_up_proj", (E, 2 * inter, hidden), device)
        _fp8_buffers(self, "down_proj", (E, hidden, inter), device)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> [T, H]: sum_j weights[t, j] * expert_{experts[t, j]}(x[t]), the sum in fp32."""
        ids = routing.experts
        T, top_k = ids.shape
        a, g = self.activations, fp8_moe_grouping(x, ids, self.n_experts)  # one row grouping for both GEMMs
        gate, up = fp8_moe(x, self.gate_up_proj, self.gate_up_proj_scale_inv, ids, a, g).chunk(2, dim=-1)
        h = self.act(gate, up).reshape(T * top_k, self.inter)  # [T * top_k, I]
        y = fp8_moe(h, self.down_proj, self.down_proj_scale_inv, ids.reshape(-1, 1), a, g).reshape(T, top_k, self.hidden)
        return torch.einsum("tjh,tj->th", y.float(), routing.weights.float()).to(x.dtype)

    def each_row(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """x [n, H], expert_ids int64 [n] in [0, E) -> [n, H]: row i through expert expert_ids[i] alone
        (no routing weight): the per-row expert outputs an expert-parallel owner sends back
        (layers/ep_moe.py), by the same two grouped GEMMs as `forward` with one slot a row."""
        ids = expert_ids.reshape(-1, 1)
        a, g = self.activations, fp8_moe_grouping(x, ids, self.n_experts)
        gate, up = fp8_moe(x, self.gate_up_proj, self.gate_up_proj_scale_inv, ids, a, g).reshape(x.shape[0], -1).chunk(2, dim=-1)
        return fp8_moe(self.act(gate, up), self.down_proj, self.down_proj_scale_inv, ids, a, g).reshape(x.shape[0], self.hidden)

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Gated activation (SiLU-GLU); subclasses change it, as `Experts.act`."""
        return F.silu(gate) * up

    @classmethod
    def from_experts(cls, experts: Experts) -> "Fp8Experts":
        """`experts`' stacked weights (bf16 / fp32) quantized to 128x128-block FP8, on their device.
        The activation is the class's (a subclass with its own `act` quantizes its own experts)."""
        E, two_i, H = experts.gate_up_proj.shape
        m = cls(E, H, two_i // 2, device=experts.gate_up_proj.device)
        _load_quantized(m, "gate_up_proj", experts.gate_up_proj)
        _load_quantized(m, "down_proj", experts.down_proj)
        return m


def fp8_modules(model: nn.Module) -> list[nn.Module]:
    """Every Fp8Linear / Fp8Experts of `model`."""
    return [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Experts))]


def fp8_activations_for(model: nn.Module, mode: str, scheme: str) -> str:
    """What `resolve_fp8_activations` sets, without setting it: "none" for a model without FP8 weights."""
    if not fp8_modules(model):
        return "none"
    return ("dynamic" if scheme == "dynamic" else "none") if mode == "auto" else mode


def resolve_fp8_activations(model: nn.Module, mode: str, scheme: str) -> tuple[str, int]:
    """Set the activations of every FP8 module of `model` from `mode` and return (what was set, how many
    modules). mode "none" / "dynamic" as `set_fp8_activations`; "auto": `scheme` (the checkpoint's
    quantization_config.activation_scheme) when it is "dynamic", as SGLang and vLLM serve block-scaled FP8
    checkpoints, else "none" (w8a16). A model without FP8 weights: ("none", 0) under "auto" and "none"."""
    picked = fp8_activations_for(model, mode, scheme)
    return picked, set_fp8_activations(model, picked)


def set_fp8_activations(model: nn.Module, activations: str) -> int:
    """Every Fp8Linear / Fp8Experts of `model` takes `activations` ("none" / "dynamic", module docstring);
    returns how many modules it set (0: the model has no FP8 weights). ValueError naming `activations`."""
    check_activations(activations)
    mods = fp8_modules(model)
    for m in mods:
        m.activations = activations
    return len(mods)
