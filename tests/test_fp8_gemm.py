"""Block-scaled FP8 weight GEMMs (kernels/fp8_gemm*.py): quantization round trip, the Triton kernels
against their references (interpreter on CPU) over ragged shapes and routings, split K, the
dequantize kernel and the prefill path, `moe_align`'s invariants. The modules, the dispatchers and
the errors are in tests/test_fp8_modules.py.

Mutation checks (each breakage applied by hand to dhisparse/kernels/fp8_gemm.py, the file run, then
restored):
  - scale of the wrong n-block (`srow = min(rn // 128 + 1, (N - 1) // 128) * ssn`): caught by
    test_fp8_linear_kernel_matches_reference_fp32 / _bf16 (N = 130, 300), test_fp8_moe_kernel_matches_reference,
    test_fp8_moe_skewed_routing_and_ragged_shapes, test_fp8_linear_from_linear and
    test_fp8_experts_from_experts (test_fp8_modules.py).
  - K mask dropped (`km = kk >= 0`): the same tests (K = 200, 129).
  - scale's k-block taken per step (`k0 // BK` for `k0 // 128`): the linear and MoE kernel tests with BK < 128.
  - MoE output written at the sorted row index: out of bounds, the interpreter segfaults in
    test_fp8_moe_kernel_matches_reference (E = 3); kept in bounds (masked to index < M) it fails that
    test, test_fp8_moe_skewed_routing_and_ragged_shapes, test_fp8_moe_bf16_and_block_m_from_rows and
    test_fp8_experts_from_experts (test_fp8_modules.py).
  - token read as the flat row (`xrow = r * sxt`, not `r // top_k`): the same four MoE tests.
  - moe_align without padding each expert's run to BM: test_moe_align_invariants and the MoE tests.
  - split K: every split running to K (`k_hi = K`: overlapping splits), or the first split's
    partial left out of the sum: test_fp8_linear_split_k_matches_reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dhisparse.kernels.fp8_gemm as fg
from dhisparse.kernels.fp8_dispatch import fp8_linear
from dhisparse.kernels.fp8_gemm import fp8_linear_triton, fp8_moe_triton, moe_align, padded_rows
from dhisparse.kernels.fp8_gemm_ref import (FP8, dequantize_block_fp8, fp8_linear_reference, fp8_moe_reference,
                                            quantize_block_fp8)
from fp8_fixtures import DEV, SHAPES, TILES, _close, _ids, _use, _weight, _x


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


@pytest.mark.parametrize("split", [1, 3])
def test_the_shared_experts_kernel_name_gives_the_same_bits(split, monkeypatch):
    """expert=True launches fp8_expert_linear_kernel, the same program under the name a profile
    counts as expert GEMMs: bit for bit the default kernel's output, whole and split-K, fp32 and
    bf16, and its name is what the profile's family table files under "moe"."""
    from bench.kernel_families import family

    w8, s = _weight(130, 200, seed=8)
    for x in (_x(7, 200), _x(5, 200, torch.bfloat16)):
        kw = dict(block_n=32, block_k=64, split_k=split)
        assert torch.equal(fp8_linear_triton(x, w8, s, expert=True, **kw), fp8_linear_triton(x, w8, s, **kw))
    assert family(fg.fp8_expert_linear_kernel.fn.__name__) == "moe"
    assert family(fg.fp8_linear_kernel.fn.__name__) == "gemm"

    class Spy:  # counts launches of the experts' kernel
        def __init__(self, k):
            self.k, self.n = k, 0

        def __getitem__(self, grid):
            self.n += 1
            return self.k[grid]

    spy = Spy(fg.fp8_expert_linear_kernel)
    monkeypatch.setattr(fg, "fp8_expert_linear_kernel", spy)
    fp8_linear_triton(_x(3, 200), w8, s, block_n=32, block_k=64, split_k=split)
    assert spy.n == 0
    fp8_linear_triton(_x(3, 200), w8, s, block_n=32, block_k=64, split_k=split, expert=True)
    assert spy.n == 1


def test_every_fp8_kernel_has_its_profile_family():
    """Each FP8 kernel's name files under the family a step profile reports it in, none under
    "other" (session 45's profile had w8a8's linear and the activation quantization there)."""
    from bench.kernel_families import family
    from dhisparse.kernels import fp8_w8a8 as fw

    want = {fg.fp8_linear_kernel: "gemm", fw.fp8_w8a8_linear_kernel: "gemm", fg.split_sum_kernel: "gemm",
            fg.fp8_moe_kernel: "moe", fw.fp8_w8a8_moe_kernel: "moe", fg.fp8_expert_linear_kernel: "moe",
            fw.fp8_w8a8_expert_linear_kernel: "moe", fw.fp8_act_quant_kernel: "fp8 quant",
            fg.fp8_dequant_kernel: "fp8 quant"}
    assert {k.fn.__name__: family(k.fn.__name__) for k in want} == {k.fn.__name__: f for k, f in want.items()}


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
    import dhisparse.kernels.fp8_tiles as ft

    monkeypatch.setattr(ft, "_programs_wanted", lambda d: 264 if d.type == "cuda" else 1)  # an H200's 132 SMs
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


@pytest.mark.parametrize("S,T,N", [(1, 3, 5), (3, 17, 130), (9, 1, 2048), (2, 0, 7), (5, 33, 1)])
def test_split_sum_adds_the_splits_in_order_and_casts_once(S, T, N):
    """`split_sum`: a split-K linear's fp32 partials [S, T, N] added in split order (the sum written out as
    a loop, bit for bit in fp32) and cast once; bf16 within one bf16 ulp (the interpreter truncates where the
    GPU rounds). (Breakage tried: the last split left out, `static_range(S - 1)`: caught.)"""
    g = torch.Generator().manual_seed(S * 100 + T)
    p = (torch.randn(S, T, N, generator=g) * torch.exp2(torch.randint(-8, 8, (S, T, N), generator=g).float())).to(DEV)
    want = torch.zeros(T, N, device=DEV)
    for s in range(S):
        want = want + p[s]
    assert torch.equal(fg.split_sum(p, torch.float32), want)
    got = fg.split_sum(p, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (T, N)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=0.0)  # one bf16 ulp (the interpreter truncates)
