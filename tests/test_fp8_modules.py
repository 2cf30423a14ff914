"""FP8 weight modules (layers/fp8_linear.py) against the bf16 / fp32 originals and the references,
the dispatchers' backend choice, and the errors naming their parameter. The kernels' own tests
and the breakages tried are in tests/test_fp8_gemm.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import dhisparse.kernels.fp8_gemm as fg
from dhisparse.kernels.fp8_dispatch import fp8_linear, fp8_moe
from dhisparse.kernels.fp8_gemm import fp8_linear_triton, fp8_moe_triton
from dhisparse.kernels.fp8_gemm_ref import FP8, dequantize_block_fp8, fp8_linear_reference, fp8_moe_reference, quantize_block_fp8
from dhisparse.layers.fp8_linear import Fp8Experts, Fp8Linear
from dhisparse.layers.moe import Experts, Routing
from dhisparse.models.tiny import tiny_config
from fp8_fixtures import DEV, _close, _ids, _use, _weight, _x


# ---- modules -------------------------------------------------------------------------------------------




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_from_linear(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(200, 130, bias=False).to(DEV, dtype)
    m = Fp8Linear.from_linear(lin)
    assert (m.in_features, m.out_features) == (200, 130)
    assert m.weight.dtype == FP8 and m.weight_scale_inv.shape == (2, 2)
    x = torch.randn(2, 3, 200).to(DEV, dtype)
    _use("torch")
    y = m(x)
    assert y.shape == (2, 3, 130) and y.dtype == dtype
    assert torch.equal(y.reshape(6, 130), fp8_linear_reference(x.reshape(6, 200), m.weight, m.weight_scale_inv))
    # quantization: each weight within 2^-4 of itself (plus subnormal slack), so |y - lin(x)| <= 2^-4 |x| @ |W|.T
    with torch.no_grad():
        bound = (x.float().abs() @ lin.weight.float().abs().T) * 2 ** -4 + 1e-3
        err = (y.float() - lin(x).float()).abs()
    slack = 0 if dtype == torch.float32 else 2 ** -7 * y.float().abs() + 2 ** -7 * lin(x).detach().float().abs()
    assert (err <= bound + slack).all()
    _use("triton")
    _close(m(x), y)


def _experts(E: int, H: int, I: int, dtype=torch.float32) -> Experts:
    cfg = dataclasses.replace(tiny_config(), n_routed_experts=E, hidden_size=H, moe_intermediate_size=I)
    ex = Experts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.2)
        ex.down_proj.normal_(0, 0.2)
    return ex.to(DEV, dtype)


def _routing(T: int, top_k: int, E: int) -> Routing:
    g = torch.Generator().manual_seed(7)
    return Routing(_ids(T, top_k, E), torch.rand(T, top_k, generator=g).to(DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_from_experts(dtype):
    E, H, I, T, top_k = 4, 136, 72, 9, 2
    ex = _experts(E, H, I, dtype)
    m = Fp8Experts.from_experts(ex)
    assert m.gate_up_proj.shape == (E, 2 * I, H) and m.gate_up_proj_scale_inv.shape == (E, 2, 2)
    assert m.down_proj.shape == (E, H, I) and m.down_proj_scale_inv.shape == (E, 2, 1)
    x = torch.randn(T, H).to(DEV, dtype)
    routing = _routing(T, top_k, E)
    _use("torch")
    y = m(x, routing)
    assert y.shape == (T, H) and y.dtype == dtype
    deq = _experts(E, H, I, dtype)  # the same function on the dequantized weights
    with torch.no_grad():
        deq.gate_up_proj.copy_(dequantize_block_fp8(m.gate_up_proj, m.gate_up_proj_scale_inv))
        deq.down_proj.copy_(dequantize_block_fp8(m.down_proj, m.down_proj_scale_inv))
        want_deq, want = deq(x, routing), ex(x, routing)
    if dtype == torch.float32:
        _close(y, want_deq)
    else:  # bf16 activations round between the layers in another order
        _close_loose(y, want_deq)
    _close_loose(y, want, 2 ** -4)  # quantization: ~2^-5 relative per weight, two layers
    _use("triton")
    _close(m(x, routing), y)


def _close_loose(got: torch.Tensor, want: torch.Tensor, rel: float = 2 ** -6) -> None:
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=rel * scale)


def test_fp8_experts_act_is_overridable():
    class Plain(Fp8Experts):
        def act(self, gate, up):
            return gate * up

    ex = _experts(3, 136, 72)
    m, p = Fp8Experts.from_experts(ex), Plain.from_experts(ex)
    x, routing = torch.randn(5, 136).to(DEV), _routing(5, 2, 3)
    _use("torch")
    gu = fp8_moe_reference(x, p.gate_up_proj, p.gate_up_proj_scale_inv, routing.experts)
    h = (gu[..., :72] * gu[..., 72:]).reshape(10, 72)
    y = fp8_moe_reference(h, p.down_proj, p.down_proj_scale_inv, routing.experts.reshape(-1, 1)).reshape(5, 2, 136)
    _close(p(x, routing), (y * routing.weights[..., None]).sum(1))
    assert not torch.allclose(p(x, routing), m(x, routing))


def test_dispatchers_pick_the_backend(monkeypatch):
    w8, s = _weight(130, 200)
    ew8, es = _weight(3, 130, 200)
    x, ids = _x(5, 200), _ids(5, 2, 3)
    calls = []
    monkeypatch.setattr(fg, "fp8_linear_triton", lambda *a, **k: calls.append("linear") or fp8_linear_reference(*a))
    monkeypatch.setattr(fg, "fp8_moe_triton", lambda *a, **k: calls.append("moe") or fp8_moe_reference(*a))
    _use("torch")
    assert torch.equal(fp8_linear(x, w8, s), fp8_linear_reference(x, w8, s))
    assert torch.equal(fp8_moe(x, ew8, es, ids), fp8_moe_reference(x, ew8, es, ids))
    assert calls == []
    _use("triton")
    fp8_linear(x, w8, s), fp8_moe(x, ew8, es, ids)
    assert calls == ["linear", "moe"]


# ---- errors --------------------------------------------------------------------------------------------


LINEARS = [fp8_linear_reference, fp8_linear_triton]
MOES = [fp8_moe_reference, fp8_moe_triton]


@pytest.mark.parametrize("fn", LINEARS)
def test_linear_errors_name_the_parameter(fn):
    w8, s = _weight(130, 200)
    x = _x(3, 200)
    with pytest.raises(ValueError, match="scale"):
        fn(x, w8, s[:, :1])
    with pytest.raises(ValueError, match="scale"):
        fn(x, w8, s.double())
    with pytest.raises(ValueError, match="w8"):
        fn(x, w8.float(), s)
    with pytest.raises(ValueError, match="w8"):
        fn(x, w8[None], s[None])
    with pytest.raises(ValueError, match="x"):
        fn(_x(3, 201), w8, s)
    with pytest.raises(ValueError, match="x"):
        fn(x.to(torch.int32), w8, s)


@pytest.mark.parametrize("fn", MOES)
def test_moe_errors_name_the_parameter(fn):
    w8, s = _weight(3, 130, 200)
    x = _x(4, 200)
    ids = _ids(4, 2, 3)
    with pytest.raises(ValueError, match="scale"):
        fn(x, w8, s[:2], ids)
    with pytest.raises(ValueError, match="w8"):
        fn(x, w8[0], s[0], ids)
    with pytest.raises(ValueError, match="expert_ids"):
        fn(x, w8, s, ids.int())
    with pytest.raises(ValueError, match="expert_ids"):
        fn(x, w8, s, ids[:3])
    if fn is fp8_moe_reference or DEV == "cpu":  # CUDA leaves ids unchecked (no host sync)
        for bad in (3, -1):
            with pytest.raises(ValueError, match="expert_ids"):
                fn(x, w8, s, torch.where(ids == ids[1, 0], bad, ids))


def test_other_errors():
    w8, s = _weight(130, 200)
    with pytest.raises(ValueError, match="scale"):
        dequantize_block_fp8(w8, s[:1])
    with pytest.raises(ValueError, match="w8"):
        dequantize_block_fp8(w8.float(), s)
    with pytest.raises(ValueError, match="w"):
        quantize_block_fp8(torch.ones(5, dtype=torch.float32))
    with pytest.raises(ValueError, match="block_n"):
        fp8_linear_triton(_x(2, 200), w8, s, block_n=48)
    with pytest.raises(ValueError, match="block_k"):
        fp8_linear_triton(_x(2, 200), w8, s, block_k=256)
    with pytest.raises(ValueError, match="bias"):
        Fp8Linear.from_linear(nn.Linear(8, 8))
