"""FP8 activations ("w8a8", kernels/fp8_w8a8.py): per-token-group quantization against its reference bit for
bit, the w8a8 linear / MoE kernels against their references over ragged, empty and split shapes, the
dispatchers and modules under `activations="dynamic"`, and the engine's --fp8-activations switch.

Mutation checks (each breakage applied by hand to dhisparse/kernels/fp8_w8a8.py, this file run, then restored):
  - the rows' group scale dropped from a k step (`part * sb[None, :]`): every kernel test here.
  - the group scale of the next k-block (`tl.minimum(k0 // 128 + 1, (K - 1) // 128)`): the linear and MoE
    tests with K > 128.
  - the token's scale read at the flat MoE row (`r * sxst` for `tok * sxst`): test_w8a8_moe_matches_reference.
  - the quantization's scale from amax / 224 (`QMAX=FP8_MAX / 2`): test_act_quant_is_the_reference_bit_for_bit.
Shared activation quantization (session 45, /tmp mutation runs, each CAUGHT by the scope tests): the scope
dropped from MLA's pre, from the GLM MoE and dense MLP, from the V4 MoE and from the V4 attention; the memo keyed
without the data pointer; the key kept past the scope; a nested scope dropping the outer one's key.
"""

from __future__ import annotations

import pytest
import torch

from dhisparse.kernels.fp8_dispatch import fp8_linear, fp8_moe
from dhisparse.kernels.fp8_gemm_ref import (FP8, check_activations, dequantize_act_fp8, fp8_linear_reference,
                                            fp8_linear_w8a8_reference, fp8_moe_reference, fp8_moe_w8a8_reference,
                                            quantize_act_fp8)
from dhisparse.kernels.fp8_w8a8 import (ACT_ROWS, fp8_act_quant_kernel, fp8_act_quant_triton, fp8_act_round_trip_triton, fp8_w8a8_linear_triton,
                                        fp8_w8a8_moe_triton)
from dhisparse.layers.fp8_linear import Fp8Experts, Fp8Linear, resolve_fp8_activations, set_fp8_activations
from dhisparse.layers.moe import Routing
from fp8_fixtures import DEV, SHAPES, TILES, _close, _ids, _use, _weight, _x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,K", [(0, 64), (1, 1), (1, 128), (5, 200), (17, 300), (33, 129)])
def test_act_quant_is_the_reference_bit_for_bit(T, K, dtype):
    x = (_x(T, K, seed=T + K) * 7).to(dtype)
    if T > 2:
        x[1] = 0  # all-zero groups: scale 1, zeros
        x[2, : min(K, 128)] = 1e-30  # tiny values (fp32): a scale near the normal range's bottom
    got, want = fp8_act_quant_triton(x), quantize_act_fp8(x)
    assert got[0].dtype == FP8 and got[0].shape == (T, K) and got[1].shape == (T, -(-K // 128))
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K", [(0, 64), (1, 1), (5, 200), (33, 129)])
def test_act_round_trip_is_the_reference_bit_for_bit(T, K, dtype):
    """The prefill path's one-pass quantize-and-dequantize (on CUDA its own kernel store) against the
    reference's composition, bit for bit, all-zero and tiny groups included."""
    x = (_x(T, K, seed=T + K + 1) * 7).to(dtype)
    if T > 2:
        x[1] = 0
        x[2, : min(K, 128)] = 1e-30 if dtype == torch.float32 else 1e-6
    got, want = fp8_act_round_trip_triton(x), dequantize_act_fp8(*quantize_act_fp8(x)).to(dtype)
    assert got.dtype == dtype and got.shape == (T, K)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_act_round_trip_kernel_store_on_representable_values():
    """The kernel's ROUND_TRIP store run directly (also under the interpreter, which the public function
    leaves for torch's rounding): every group's amax is 448 x 2^j and its values e4m3 values x 2^j, so no
    value rounds and the interpreter's FP8 rounding cannot differ. Dropping the multiply by the scale changes
    the output (tried); the rounding itself is compared with the reference on CUDA (the test above)."""
    T, K = 19, 300
    g = torch.Generator().manual_seed(3)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    e4m3 = e4m3[torch.isfinite(e4m3)]
    codes = e4m3[torch.randint(0, e4m3.numel(), (T, K), generator=g)]
    codes[:, ::128] = 448.0  # each group's amax: 448
    x = (codes * torch.exp2(torch.randint(-6, 7, (T, 1), generator=g).float())).to(torch.bfloat16).to(DEV)
    out = torch.empty_like(x)
    fp8_act_quant_kernel[(-(-T // ACT_ROWS), -(-K // 128))](x, out, out, T, K, x.stride(0), out.stride(0), 0,
                                                           R=ACT_ROWS, G=128, QMAX=448.0, ROUND_TRIP=True)
    assert torch.equal(out, x)  # representable: the round trip is the identity
    want = dequantize_act_fp8(*quantize_act_fp8(x)).to(x.dtype)
    assert torch.equal(out, want)


@pytest.mark.parametrize("quantize", [quantize_act_fp8, fp8_act_quant_triton, fp8_act_round_trip_triton])
def test_act_quantizers_refuse_what_they_cannot_take(quantize):
    for bad in (torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, 4), torch.ones(2, 3).to(FP8)):
        with pytest.raises(ValueError, match="x must be a floating"):
            quantize(bad.to(DEV))


def test_act_quant_round_trip_is_within_e4m3_precision():
    x = _x(9, 300, seed=4) * torch.exp2(torch.arange(9, device=DEV, dtype=torch.float32) - 4)[:, None]
    x8, xs = quantize_act_fp8(x)
    back = dequantize_act_fp8(x8, xs)
    group_max = x.abs().reshape(9, -1)[:, :256].reshape(9, 2, 128).amax(-1)  # first two groups
    err = (back - x).abs()[:, :256].reshape(9, 2, 128).amax(-1)
    assert (err <= group_max * 2 ** -4 + 1e-30).all()  # e4m3: 3 mantissa bits, half-ulp 2^-4 of the group max
    assert xs.amax().item() > 0 and torch.all(x8.float().abs() <= 448)


@pytest.mark.parametrize("tiles", list(TILES) + ["split"])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", [0, 1, 17, 33])
def test_w8a8_linear_matches_reference(T, N, K, tiles):
    w8, s = _weight(N, K)
    x = _x(T, K, seed=T)
    kw = {"split_k": 3, "block_k": 64} if tiles == "split" else TILES[tiles]
    got = fp8_w8a8_linear_triton(x, w8, s, **kw)
    assert got.shape == (T, N)
    _close(got, fp8_linear_w8a8_reference(x, w8, s))


def test_w8a8_linear_bf16_and_shared_expert_name():
    w8, s = _weight(130, 200, seed=2)
    x = _x(17, 200, torch.bfloat16)
    want = fp8_linear_w8a8_reference(x, w8, s)
    _close(fp8_w8a8_linear_triton(x, w8, s), want)
    assert torch.equal(fp8_w8a8_linear_triton(x, w8, s, expert=True), fp8_w8a8_linear_triton(x, w8, s))


def test_w8a8_differs_from_w8a16_by_the_activation_rounding():
    """The quantized activations change the product (else the switch would be a no-op), by about e4m3's precision."""
    w8, s = _weight(128, 384, seed=7)
    x = _x(9, 384, seed=8)
    a, b = fp8_linear_w8a8_reference(x, w8, s), fp8_linear_reference(x, w8, s)
    rel = ((a - b).norm() / b.norm()).item()
    assert 1e-4 < rel < 0.1


@pytest.mark.parametrize("E,top_k,T", [(1, 1, 0), (3, 2, 7), (8, 3, 20), (3, 1, 1)])
def test_w8a8_moe_matches_reference(E, top_k, T):
    w8, s = _weight(E, 130, 200, seed=E)
    x = _x(T, 200, seed=T)
    ids = _ids(T, top_k, E)
    got = fp8_w8a8_moe_triton(x, w8, s, ids, block_n=32, block_k=64)
    assert got.shape == (T, top_k, 130)
    _close(got, fp8_moe_w8a8_reference(x, w8, s, ids))


@pytest.mark.parametrize("pattern", ["all", "sparse"])
def test_w8a8_moe_skewed_routing_ragged(pattern):
    w8, s = _weight(8, 300, 129, seed=5)
    x, ids = _x(20, 129), _ids(20, 3, 8, pattern)
    _close(fp8_w8a8_moe_triton(x, w8, s, ids), fp8_moe_w8a8_reference(x, w8, s, ids))


def test_dispatchers_take_the_activations_setting():
    w8, s = _weight(130, 200)
    ew8, es = _weight(3, 130, 200)
    x, ids = _x(5, 200), _ids(5, 2, 3)
    for backend in ("torch", "triton"):
        _use(backend)
        _close(fp8_linear(x, w8, s, activations="dynamic"), fp8_linear_w8a8_reference(x, w8, s))
        _close(fp8_moe(x, ew8, es, ids, "dynamic"), fp8_moe_w8a8_reference(x, ew8, es, ids))
        _close(fp8_moe(x, ew8, es, ids), fp8_moe_reference(x, ew8, es, ids))
    with pytest.raises(ValueError, match="activations"):
        fp8_linear(x, w8, s, activations="static")
    with pytest.raises(ValueError, match="activations"):
        check_activations("fp8")


def test_prefill_sized_dynamic_linear_rounds_the_activations(monkeypatch):
    """At DEQUANT_ROWS and above a 16-bit dynamic linear multiplies the dequantized weight by the round-tripped
    activations: the w8a8 product up to bf16 rounding, not the w8a16 one."""
    import dhisparse.kernels.fp8_dispatch as fd

    monkeypatch.setattr(fd, "DEQUANT_ROWS", 8)
    _use("triton")
    w8, s = _weight(128, 256, seed=9)
    x = _x(12, 256, torch.bfloat16, seed=10)
    got = fp8_linear(x, w8, s, activations="dynamic")
    _close(got, fp8_linear_w8a8_reference(x, w8, s))
    assert not torch.equal(got, fp8_linear(x, w8, s))


def test_modules_follow_set_fp8_activations():
    torch.manual_seed(0)
    lin = Fp8Linear.from_linear(torch.nn.Linear(200, 130, bias=False).to(DEV))
    ex = Fp8Experts(3, 200, 128, device=DEV)
    ex.gate_up_proj.copy_(_weight(3, 256, 200)[0]), ex.down_proj.copy_(_weight(3, 200, 128)[0])
    model = torch.nn.ModuleDict({"lin": lin, "ex": ex})
    x, ids = _x(6, 200), _ids(6, 2, 3)
    r = Routing(ids, torch.full((6, 2), 0.5, device=DEV))
    plain_lin, plain_ex = lin(x), ex(x, r)
    assert set_fp8_activations(model, "dynamic") == 2 and lin.activations == ex.activations == "dynamic"
    _close(lin(x), fp8_linear_w8a8_reference(x, lin.weight, lin.weight_scale_inv))
    assert not torch.equal(lin(x), plain_lin) and not torch.equal(ex(x, r), plain_ex)
    assert set_fp8_activations(model, "none") == 2
    assert torch.equal(lin(x), plain_lin) and torch.equal(ex(x, r), plain_ex)
    assert set_fp8_activations(torch.nn.Linear(2, 2), "dynamic") == 0
    with pytest.raises(ValueError, match="activations"):
        set_fp8_activations(model, "w8a8")


def test_auto_follows_the_checkpoints_activation_scheme():
    """--fp8-activations auto (the default): "dynamic" where the checkpoint's activation_scheme is (DeepSeek-V3 /
    GLM-5 FP8), "none" for another scheme and for a model without FP8 weights; an explicit mode wins."""
    lin = Fp8Linear.from_linear(torch.nn.Linear(200, 130, bias=False).to(DEV))
    model = torch.nn.ModuleDict({"lin": lin, "ex": Fp8Experts(3, 200, 128, device=DEV)})
    assert resolve_fp8_activations(model, "auto", "dynamic") == ("dynamic", 2) and lin.activations == "dynamic"
    assert resolve_fp8_activations(model, "auto", "static") == ("none", 2) and lin.activations == "none"
    assert resolve_fp8_activations(model, "dynamic", "static") == ("dynamic", 2)
    assert resolve_fp8_activations(model, "none", "dynamic") == ("none", 2) and lin.activations == "none"
    assert resolve_fp8_activations(torch.nn.Linear(2, 2), "auto", "dynamic") == ("none", 0)


def test_engine_refuses_dynamic_activations_without_fp8_weights():
    from dhisparse.engine.config import ConfigValueError, EngineConfig
    from dhisparse.engine.engine import Engine

    assert EngineConfig().fp8_activations == "auto"
    with pytest.raises(ConfigValueError, match="fp8_activations"):
        EngineConfig(model="tiny", fp8_activations="fp8")
    with pytest.raises(ValueError, match="fp8_activations.*FP8"):
        Engine(EngineConfig(model="tiny", device="cpu", fp8_activations="dynamic"))
    e = Engine(EngineConfig(model="tiny", device="cpu"))  # auto on a model without FP8 weights: none, no error
    assert e.fp8_activations == "none"
    e.close()


@pytest.mark.parametrize("activations", ["none", "dynamic"])
def test_a_moe_layer_groups_its_rows_once(activations, monkeypatch):
    """Fp8Experts' gate-up and down GEMMs share one `moe_align` (ids [T, top_k] and [T * top_k, 1] are the same
    flat rows): one call a forward on the Triton path, the same bits as each GEMM grouping its own rows; a
    grouping made for other rows is refused by name. (Breakage tried: the down GEMM given a grouping made at
    another BM: refused here.)"""
    import dhisparse.kernels.fp8_tiles as ft
    from dhisparse.kernels.fp8_gemm import fp8_moe_triton
    from dhisparse.kernels.fp8_tiles import moe_grouping

    _use("triton")
    ex = Fp8Experts(4, 200, 128, device=DEV)
    ex.gate_up_proj.copy_(_weight(4, 256, 200)[0]), ex.down_proj.copy_(_weight(4, 200, 128)[0])
    ex.activations = activations
    x, ids = _x(9, 200), _ids(9, 2, 4)
    r = Routing(ids, torch.full((9, 2), 0.5, device=DEV))
    import dhisparse.kernels.fp8_gemm as fg
    import dhisparse.kernels.fp8_w8a8 as fw

    calls = []
    real = ft.moe_align
    for mod in (ft, fg, fw):  # each module calls the name it imported
        monkeypatch.setattr(mod, "moe_align", lambda *a: calls.append(a[2]) or real(*a))
    got = ex(x, r)
    assert len(calls) == 1
    for mod in (ft, fg, fw):
        monkeypatch.setattr(mod, "moe_align", real)
    gu = fp8_moe_triton(x, ex.gate_up_proj, ex.gate_up_proj_scale_inv, ids) if activations == "none" else \
        fp8_w8a8_moe_triton(x, ex.gate_up_proj, ex.gate_up_proj_scale_inv, ids)
    gate, up = gu.chunk(2, dim=-1)
    h = (torch.nn.functional.silu(gate) * up).reshape(18, 128)
    fn = fp8_moe_triton if activations == "none" else fp8_w8a8_moe_triton
    y = fn(h, ex.down_proj, ex.down_proj_scale_inv, ids.reshape(-1, 1)).reshape(9, 2, 200)
    assert torch.equal(got, torch.einsum("tjh,tj->th", y.float(), r.weights.float()).to(x.dtype))
    other = real(ids, 4, 16 if calls[0] != 16 else 32)
    with pytest.raises(ValueError, match="grouping"):
        fn(h, ex.down_proj, ex.down_proj_scale_inv, ids.reshape(-1, 1), grouping=other)
    assert torch.equal(moe_grouping(ids, 4)[0], real(ids, 4, calls[0])[0])


def _count_quant(monkeypatch) -> list[tuple]:
    """Record each activation quantization the w8a8 kernels run (the view it quantized)."""
    import dhisparse.kernels.fp8_w8a8 as fw

    seen, real = [], fw.fp8_act_quant_triton
    monkeypatch.setattr(fw, "fp8_act_quant_triton", lambda x: seen.append((x.data_ptr(), tuple(x.shape))) or real(x))
    return seen


def test_one_scope_quantizes_a_shared_activation_once(monkeypatch):
    """Inside `shared_activations(x)` the w8a8 GEMMs reading that view of x quantize it once (two linears and a
    MoE's gate-up: one quantization, plus the down GEMM's input), with the same bits as each quantizing its
    own; a copy or another view of x, and any other activation, is quantized per call and not kept; the memo
    ends with the scope, and a nested scope on x shares the outer one's."""
    import dhisparse.kernels.fp8_w8a8 as fw
    from dhisparse.kernels.fp8_dispatch import shared_activations

    _use("triton")
    torch.manual_seed(0)
    a = Fp8Linear.from_linear(torch.nn.Linear(200, 130, bias=False).to(DEV))
    b = Fp8Linear.from_linear(torch.nn.Linear(200, 64, bias=False).to(DEV), expert=True)
    ex = Fp8Experts(3, 200, 128, device=DEV)
    ex.gate_up_proj.copy_(_weight(3, 256, 200)[0]), ex.down_proj.copy_(_weight(3, 200, 128)[0])
    set_fp8_activations(torch.nn.ModuleList([a, b, ex]), "dynamic")
    x, y, ids = _x(7, 200, seed=4), _x(7, 200, seed=5), _ids(7, 2, 3)
    r = Routing(ids, torch.full((7, 2), 0.5, device=DEV))
    seen = _count_quant(monkeypatch)
    apart = (a(x), b(x), ex(x, r))
    assert len(seen) == 4
    seen.clear()
    with shared_activations(x):
        shared = (a(x), b(x), ex(x, r))
        assert len(seen) == 2  # x once, the experts' hidden rows once
        a(x.clone()), a(x[1:]), a(y), a(y)  # a copy, another view, another activation twice: per call
        assert len(seen) == 6 and len(fw._SHARED.memo) == 1
        with shared_activations(x):
            b(x)  # the outer scope's quantization
        assert len(seen) == 6
    assert all(torch.equal(p, q) for p, q in zip(apart, shared))
    assert fw._SHARED.memo == {}
    a(x)
    assert len(seen) == 7  # the memo ended with the scope


def test_glm_layers_open_their_scopes(monkeypatch):
    """glm5-faithful's layers under w8a8 (small build, Triton path under the interpreter): MLA's pre
    quantizes the normed hidden state once for q_a and kv_a, the MoE its input once for the routed
    gate-up and the shared experts' gate and up, a dense MLP once for gate and up."""
    from dhisparse.layers.moe import MLP, MoE
    from dhisparse.layers.rope import RopeTables
    from dhisparse.models.faithful import SMALL_OVERRIDES, build_faithful

    _use("triton")
    lm = build_faithful(num_layers=4, overrides=SMALL_OVERRIDES, dtype=torch.float32, device=DEV)
    set_fp8_activations(lm.model, "dynamic")
    layers = lm.model.model.layers
    moe = next(l.mlp for l in layers if isinstance(l.mlp, MoE))
    dense = next(l.mlp for l in layers if isinstance(l.mlp, MLP))
    T, H = 5, lm.config.hidden_size
    x = _x(T, H, seed=6)
    seen = _count_quant(monkeypatch)
    moe(x)
    # x once (routed gate-up, shared gate, shared up), then the routed and the shared down inputs
    assert len(seen) == 3 and seen.count((x.data_ptr(), (T, H))) == 1
    seen.clear()
    dense(x)
    assert len(seen) == 2 and seen.count((x.data_ptr(), (T, H))) == 1
    seen.clear()
    rope = RopeTables.build(*lm.model.model.rotary_emb(torch.arange(T, device=DEV), x.dtype))
    layers[0].self_attn.pre(x, rope.C, rope.S)
    assert seen.count((x.data_ptr(), (T, H))) == 1 and len(seen) == 2  # q_a / kv_a once, q_b's input once


def test_v4_layers_open_their_scopes(monkeypatch):
    """v41-faithful's layers under w8a8 (small build): the MoE's input quantized once for the routed gate-up
    and the shared expert's gate and up (a hash-routed layer and a scored one), the attention's once for
    q_a and kv."""
    from test_v41_faithful import SMALL  # v41-faithful's small geometry

    from dhisparse.layers.v4_moe import V4MoE
    from dhisparse.models.v4_faithful import build_v41_faithful

    _use("triton")
    lm = build_v41_faithful(num_layers=4, overrides=SMALL, dtype=torch.float32, device=DEV)
    set_fp8_activations(lm.model, "dynamic")
    moes = [m for m in lm.model.modules() if isinstance(m, V4MoE)]
    T = 5
    x, ids = _x(T, 256, seed=8), torch.arange(T, device=DEV)
    seen = _count_quant(monkeypatch)
    for moe in (moes[0], moes[-1]):  # hash-routed, scored
        seen.clear()
        moe(x, ids)
        assert seen.count((x.data_ptr(), (T, 256))) == 1 and len(seen) == 3

    class Stop(Exception):
        pass

    class Ctx:  # the pass context: stop at the window's store, after the projections
        def window(self, *a):
            raise Stop

    from dhisparse.layers.v4_attention import V4RopeTables

    m = lm.model.model
    pos = torch.arange(T, device=DEV)
    ropes = V4RopeTables(m.rope_main(pos, x.dtype), m.rope_compress(pos, x.dtype), m.rope_compress)
    seen.clear()
    with pytest.raises(Stop):
        m.layers[0].self_attn(x, ropes, None, Ctx())
    assert seen.count((x.data_ptr(), (T, 256))) == 1 and len(seen) == 2  # q_a / kv once, q_b's input once
