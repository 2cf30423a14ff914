"""Block-scaled FP8 weight GEMMs (kernels/fp8_gemm*.py, layers/fp8_linear.py): quantization round
trip, the Triton kernels against their references (interpreter on CPU) over ragged shapes and
routings, `moe_align`'s invariants, the modules against the bf16 / fp32 originals, and the errors.

Mutation checks (each breakage applied by hand to dhisparse/kernels/fp8_gemm.py, the file run, then
restored):
  - scale of the wrong n-block (`srow = min(rn // 128 + 1, (N - 1) // 128) * ssn`): caught by
    test_fp8_linear_kernel_matches_reference_fp32 / _bf16 (N = 130, 300), test_fp8_moe_kernel_matches_reference,
    test_fp8_moe_skewed_routing_and_ragged_shapes, test_fp8_linear_from_linear, test_fp8_experts_from_experts.
  - K mask dropped (`km = kk >= 0`): the same tests (K = 200, 129).
  - scale's k-block taken per step (`k0 // BK` for `k0 // 128`): the linear and MoE kernel tests with BK < 128.
  - MoE output written at the sorted row index: out of bounds, the interpreter segfaults in
    test_fp8_moe_kernel_matches_reference (E = 3); kept in bounds (masked to index < M) it fails that
    test, test_fp8_moe_skewed_routing_and_ragged_shapes, test_fp8_moe_bf16_and_block_m_from_rows and
    test_fp8_experts_from_experts.
  - token read as the flat row (`xrow = r * sxt`, not `r // top_k`): the same four MoE tests.
  - moe_align without padding each expert's run to BM: test_moe_align_invariants and the MoE tests.
  - split K: every split running to K (`k_hi = K`: overlapping splits), or the first split's
    partial left out of the sum: test_fp8_linear_split_k_matches_reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dhisparse.kernels.fp8_gemm as fg
from dhisparse.kernels import backend as kernel_backend
from dhisparse.kernels.backend import KernelSettings
from dhisparse.kernels.fp8_dispatch import fp8_linear, fp8_moe
from dhisparse.kernels.fp8_gemm import fp8_linear_triton, fp8_moe_triton, moe_align, padded_rows
from dhisparse.kernels.fp8_gemm_ref import (FP8, dequantize_block_fp8, fp8_linear_reference, fp8_moe_reference,
                                            quantize_block_fp8)
from dhisparse.layers.fp8_linear import Fp8Experts, Fp8Linear
from dhisparse.layers.moe import Experts, Routing
from dhisparse.models.tiny import tiny_config

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


# ---- quantization ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 128), (130, 200), (1, 1), (3, 257, 129)])
def test_quantize_round_trip_error_is_bounded_per_block(shape):
    w = torch.randn(*shape) * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1)).float())
    w8, s = quantize_block_fp8(w)
    nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    assert w8.dtype == FP8 and w8.shape == w.shape and s.dtype == torch.float32 and s.shape == (*shape[:-2], nb, kb)
    deq = dequantize_block_fp8(w8, s)
    err = (deq - w).abs()
    amax = s * 448.0  # a block's amax: scale = amax / 448
    per = amax.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]
    assert (err <= 2 ** -3 * per).all()  # e4m3: 3 mantissa bits
    scale = s.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]
    assert (err <= 2 ** -4 * w.abs() + 2 ** -10 * scale + 1e-6 * per).all()  # half an ulp, subnormals below 2^-6
    blocks = torch.nn.functional.pad(w.abs(), (0, kb * 128 - shape[-1], 0, nb * 128 - shape[-2]))
    true_amax = blocks.reshape(*shape[:-2], nb, 128, kb, 128).amax(dim=(-3, -1))
    torch.testing.assert_close(amax, true_amax, rtol=1e-6, atol=0)


def test_zero_blocks_get_scale_one_and_stay_zero():
    w = torch.randn(130, 200)
    w[:128, 128:] = 0  # one whole block
    w[128:, :] = 0  # the partial bottom row of blocks
    w8, s = quantize_block_fp8(w)
    assert s[0, 1] == 1.0 and (s[1] == 1.0).all() and (s[0, 0] != 1.0)
    deq = dequantize_block_fp8(w8, s)
    assert torch.isfinite(deq).all() and (deq[:128, 128:] == 0).all() and (deq[128:] == 0).all()
    w8z, sz = quantize_block_fp8(torch.zeros(5, 7))
    assert (sz == 1.0).all() and (dequantize_block_fp8(w8z, sz) == 0).all()


def test_quantize_accepts_bf16():
    w = torch.randn(130, 200)
    w8, s = quantize_block_fp8(w.bfloat16())
    w8f, sf = quantize_block_fp8(w.bfloat16().float())
    assert torch.equal(w8.view(torch.uint8), w8f.view(torch.uint8)) and torch.equal(s, sf)


# ---- fp8_linear ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", [0, 1, 5, 17, 33])
def test_fp8_linear_kernel_matches_reference_fp32(T, N, K, tiles):
    w8, s = _weight(N, K)
    x = _x(T, K)
    got = fp8_linear_triton(x, w8, s, **TILES[tiles])
    _close(got, fp8_linear_reference(x, w8, s))
    assert got.shape == (T, N)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("T", [1, 17])
def test_fp8_linear_kernel_matches_reference_bf16(T, N, K):
    w8, s = _weight(N, K, seed=2)
    x = _x(T, K, torch.bfloat16)
    _close(fp8_linear_triton(x, w8, s, block_n=32, block_k=64), fp8_linear_reference(x, w8, s))


@pytest.mark.parametrize("split", [2, 3, 7, 50])
@pytest.mark.parametrize("N,K", [(130, 200), (64, 384), (300, 129)])
def test_fp8_linear_split_k_matches_reference(split, N, K):
    """Split K (fp32 partials added in split order): any split count, capped at one K step a split,
    no empty split when K steps do not divide evenly (K 384 / BK 32 = 12 steps in 7 splits)."""
    w8, s = _weight(N, K, seed=5)
    for T in (1, 17):
        x = _x(T, K)
        _close(fp8_linear_triton(x, w8, s, block_n=32, block_k=32, split_k=split), fp8_linear_reference(x, w8, s))
    xb = _x(5, K, torch.bfloat16)
    _close(fp8_linear_triton(xb, w8, s, block_n=32, block_k=64, split_k=split), fp8_linear_reference(xb, w8, s))


def test_split_k_for_fills_the_gpu_only_for_small_passes(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(fg, "_programs_wanted", lambda d: 264 if d.type == "cuda" else 1)  # an H200's 132 SMs
    assert fg.split_k_for(47, 2048, 6144, 64, 64, 128, cuda) == 9  # q_a: 32 tiles -> 9 splits (288 programs)
    assert fg.split_k_for(47, 16384, 2048, 64, 64, 128, cuda) == 2  # q_b: 256 tiles
    assert fg.split_k_for(47, 6144, 16384, 64, 64, 128, cuda) == 3  # o_proj: 96 tiles
    assert fg.split_k_for(47, 576, 6144, 64, 64, 128, cuda) == 30  # kv_a: 9 tiles
    assert fg.split_k_for(47, 64, 256, 64, 64, 128, cuda) == 2  # capped at K's two steps
    assert fg.split_k_for(300, 2048, 6144, 64, 64, 128, cuda) == 1  # past SPLIT_MAX_ROWS: never
    assert fg.split_k_for(47, 2048, 6144, 64, 64, 128, torch.device("cpu")) == 1


def test_fp8_linear_strided_x():
    w8, s = _weight(130, 200)
    x = _x(9, 400)[:, ::2]  # non-unit last stride: copied
    _close(fp8_linear_triton(x, w8, s), fp8_linear_reference(x, w8, s))
    x = _x(9, 300)[:, :200]  # row stride 300
    _close(fp8_linear_triton(x, w8, s), fp8_linear_reference(x, w8, s))


# ---- fp8_moe -------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("T", [0, 1, 7, 20])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("E", [1, 3, 8])
def test_fp8_moe_kernel_matches_reference(E, top_k, T):
    w8, s = _weight(E, 130, 200, seed=E)
    x = _x(T, 200, seed=T)
    ids = _ids(T, top_k, E)
    got = fp8_moe_triton(x, w8, s, ids, block_n=32, block_k=64)
    assert got.shape == (T, top_k, 130)
    _close(got, fp8_moe_reference(x, w8, s, ids))


@pytest.mark.parametrize("pattern", ["all", "sparse"])
@pytest.mark.parametrize("N,K,tiles", [(130, 200, "small"), (300, 129, "gpu"), (64, 384, "wide")])
def test_fp8_moe_skewed_routing_and_ragged_shapes(N, K, tiles, pattern):
    E, T, top_k = 8, 20, 3
    w8, s = _weight(E, N, K, seed=5)
    x = _x(T, K)
    ids = _ids(T, top_k, E, pattern)  # experts 1..6 receive nothing; "all": expert 7 receives every row
    _close(fp8_moe_triton(x, w8, s, ids, **TILES[tiles]), fp8_moe_reference(x, w8, s, ids))


def test_fp8_moe_bf16_and_block_m_from_rows():
    E, T, top_k = 3, 40, 2  # 80 rows over 3 experts: the default BM is 32
    w8, s = _weight(E, 130, 200, seed=6)
    x = _x(T, 200, torch.bfloat16)
    ids = _ids(T, top_k, E)
    assert fg.block_m_for(-(-T * top_k // E)) == 32
    _close(fp8_moe_triton(x, w8, s, ids), fp8_moe_reference(x, w8, s, ids))


# ---- moe_align -----------------------------------------------------------------------------------------


def _align_plain(flat: list[int], E: int, BM: int) -> tuple[list[int], list[int]]:
    """moe_align in plain Python: each expert's rows in order, padded with M to a multiple of BM."""
    M = len(flat)
    rows, experts = [], []
    for e in range(E):
        mine = [r for r in range(M) if flat[r] == e]
        n = -(-len(mine) // BM) * BM
        rows += mine + [M] * (n - len(mine))
        experts += [e] * (n // BM)
    P = padded_rows(M, E, BM)
    return rows + [M] * (P - len(rows)), experts + [E] * (P // BM - len(experts))


@settings(max_examples=80, deadline=None)
@given(E=st.integers(1, 9), top_k=st.integers(1, 4), BM=st.sampled_from([16, 32]), T=st.integers(0, 12),
       invalid=st.booleans(), data=st.data())
def test_moe_align_invariants(E, top_k, BM, T, invalid, data):
    hi = E if invalid else E - 1  # ids -1 and E (invalid) appear only when `invalid`
    lo = -1 if invalid else 0
    flat = data.draw(st.lists(st.integers(lo, hi), min_size=T * top_k, max_size=T * top_k))
    ids = torch.tensor(flat, dtype=torch.int64).reshape(T, top_k)
    rows, block_expert = moe_align(ids.to(DEV), E, BM)
    rows, block_expert = rows.cpu(), block_expert.cpu()
    M, P = T * top_k, padded_rows(T * top_k, E, BM)
    assert rows.dtype == block_expert.dtype == torch.int32
    assert rows.shape == (P,) and P % BM == 0 and P <= M + E * (BM - 1) + BM - 1
    assert block_expert.shape == (P // BM,)
    real = rows[rows < M]
    valid = [r for r in range(M) if 0 <= flat[r] < E]
    assert sorted(real.tolist()) == valid  # every real row exactly once, invalid ids nowhere
    assert (rows[rows >= M] == M).all()  # pads are M: out of range, masked
    for b, e in enumerate(block_expert.tolist()):
        blk = rows[b * BM : (b + 1) * BM]
        if e == E:
            assert (blk == M).all()
        else:
            assert 0 <= e < E and blk[0] < M and all(flat[r] == e for r in blk[blk < M].tolist())
    used = block_expert[block_expert < E]
    assert (block_expert[: used.numel()] == used).all() and (used.diff() >= 0).all()  # a prefix, one run per expert
    want_rows, want_experts = _align_plain(flat, E, BM)
    assert rows.tolist() == want_rows and block_expert.tolist() == want_experts


# ---- modules -------------------------------------------------------------------------------------------


def _use(backend: str) -> None:
    kernel_backend.configure(KernelSettings(backend=backend))


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
    monkeypatch.setattr(fg, "fp8_linear_triton", lambda *a: calls.append("linear") or fp8_linear_reference(*a))
    monkeypatch.setattr(fg, "fp8_moe_triton", lambda *a: calls.append("moe") or fp8_moe_reference(*a))
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


def test_tiles_for_prefill_and_decode():
    assert fg.block_m_for(300) == 128 and fg.block_m_for(256) == 64 and fg.block_m_for(16) == 16
    assert fg.tiles_for(8192, None, None) == (128, 8) and fg.tiles_for(47, None, None) == (64, 4)
    assert fg.tiles_for(8192, 32, 2) == (32, 2)


def test_fp8_linear_large_pass_tiles_match_reference():
    """A pass past LARGE_ROWS (BM 128, BN 128, 8 warps: the prefill tiles) on ragged N / K."""
    w8, s = _weight(130, 200, seed=6)
    x = _x(300, 200)
    _close(fp8_linear_triton(x, w8, s), fp8_linear_reference(x, w8, s))


@pytest.mark.parametrize("N,K", [(130, 200), (300, 129), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequantize_kernel_is_the_reference_bit_for_bit(N, K, dtype):
    """Bit for bit on the GPU (one fp32 product, one round-to-nearest cast). The CPU interpreter
    truncates fp32 -> bf16 casts, so there a bf16 value may sit one ulp below the reference's."""
    w8, s = _weight(N, K, seed=8)
    got, want = fg.fp8_dequantize_triton(w8, s, dtype), dequantize_block_fp8(w8, s).to(dtype)
    if DEV == "cuda" or dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7).all()  # one ulp
        assert (got.float().abs() <= want.float().abs()).all()  # truncated, toward zero


def test_large_16bit_linears_multiply_the_dequantized_weight(monkeypatch):
    """From DEQUANT_ROWS rows a bf16 / fp16 linear dequantizes its weight (one Triton pass) and runs
    torch.matmul; fewer rows, or fp32, keep the FP8 GEMM. (Breakage tried: the dequant kernel's
    scale taken from block (0, 0) for every tile; caught here and by the bit-for-bit test.)"""
    import dhisparse.kernels.fp8_dispatch as fd

    monkeypatch.setattr(fd, "DEQUANT_ROWS", 24)
    w8, s = _weight(130, 200, seed=9)
    calls = []
    monkeypatch.setattr(fg, "fp8_linear_triton", lambda *a, **k: calls.append(1) or fp8_linear_reference(*a))
    _use("triton")
    x = _x(24, 200, torch.bfloat16)
    _close(fp8_linear(x, w8, s), fp8_linear_reference(x, w8, s))
    assert calls == []
    fp8_linear(_x(23, 200, torch.bfloat16), w8, s)
    fp8_linear(_x(24, 200), w8, s)
    assert calls == [1, 1]
