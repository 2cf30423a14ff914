"""FP8 KV rows (`--kv-cache-dtype fp8_e4m3`, core/kvformat.py): the quantizer bit for bit against a
plain per-tile reference of the same formula and layout, the e4m3 round-trip bound, no
re-quantization (encode . decode . encode = encode), the kernels reading FP8 rows against their
references (odd, ragged and empty shapes), bad settings refused, and deliberate breakages caught.
Serving under FP8 (every preset token-identical) is in test_kv_fp8_serving.py, the HF checkpoints and
DeepSeek-V4 under FP8 in test_kv_fp8_models.py (three files, so that no one file bounds a parallel run
on the GPU)."""

from __future__ import annotations

import struct

import pytest
import torch

from dhisparse.core.batch import IndexTable
from dhisparse.core.kvformat import KVFormats, RowFormat, check_device
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.kernels.indexer import indexer_scores_triton
from dhisparse.kernels.indexer_torch import indexer_scores_torch
from dhisparse.kernels import sparse_mla as sm
from dhisparse.kernels.sparse_mla_ref import sparse_mla_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MLA = KVFormats.mla("fp8_e4m3", 576, 64, 128, torch.bfloat16)  # GLM-5 / V3.2 production shape
V4 = KVFormats.v4("fp8_e4m3", 512, 64, 128, torch.bfloat16)


# -- the quantizer ---------------------------------------------------------------------------------
def plain_encode(x: torch.Tensor, n: int, rope: int, tile: int, ue8m0: bool, rope_first: bool, align: int) -> torch.Tensor:
    """The layout written out by hand, one row and one tile at a time (struct for the scales)."""
    out = []
    for row in x.float():
        q, scales = [], b""
        for j in range(0, n, tile):
            t = row[j : j + tile]
            s = max(float(t.abs().max()), 1e-4) / 448.0
            s = torch.tensor(s, dtype=torch.float32)
            if ue8m0:
                s = torch.exp2(torch.ceil(torch.log2(s)))
            q.append((t / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
            scales += struct.pack("<f", float(s)) if not ue8m0 else bytes([int(torch.log2(s)) + 127])
        vals = torch.cat(q).tolist()
        rp = row[n:].to(torch.bfloat16).view(torch.uint8).tolist()
        body = vals + (rp + list(scales) if rope_first else list(scales) + rp)
        out.append(body + [0] * (-len(body) % align))
    return torch.tensor(out, dtype=torch.uint8)


def rows_to_quantize(n_rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, dim, generator=g) * torch.logspace(-3, 3, n_rows)[:, None]
    x[0] = 0.0  # an all-zero row: the amax floor
    x[1, :7] = 1e-9  # values far below one e4m3 subnormal step
    return x


@pytest.mark.parametrize("fmt", [MLA.latent, MLA.index, V4.latent, V4.index,
                                 KVFormats.mla("fp8_e4m3", 40, 8, 16, torch.float32).latent],
                         ids=lambda f: f"{f.dim}-{f.scale}")
def test_quantizer_matches_a_plain_reference_bit_for_bit(fmt):
    x = rows_to_quantize(9, fmt.dim, seed=fmt.dim)
    want = plain_encode(x, fmt.quantized, fmt.rope, fmt.tile, fmt.scale == "ue8m0", fmt.rope_first, fmt.align)
    got = fmt.encode(x)
    assert got.dtype == torch.uint8 and got.shape == (9, fmt.width)
    assert torch.equal(got, want)
    assert fmt.encode(x[:0]).shape == (0, fmt.width) and fmt.decode(got[:0]).shape == (0, fmt.dim)


def test_row_sizes_are_the_papers():
    assert (MLA.latent.nbytes, MLA.index.nbytes, V4.latent.nbytes) == (656, 132, 584)
    plain = KVFormats.mla("auto", 576, 64, 128, torch.bfloat16)
    assert (plain.latent.nbytes, plain.index.nbytes, plain.fp8) == (1152, 256, False)


@pytest.mark.parametrize("fmt", [MLA.latent, V4.latent, MLA.index], ids=lambda f: f"{f.dim}-{f.scale}")
def test_round_trip_error_is_within_the_e4m3_bound(fmt):
    fmt32 = RowFormat(fmt.dim, torch.float32, True, fmt.rope, fmt.tile, fmt.scale, fmt.rope_first, fmt.align)
    x = rows_to_quantize(12, fmt.dim, seed=1)
    y = fmt32.round_trip(x)
    Q = fmt.quantized
    s = fmt32.scales_of(x[:, :Q]).repeat_interleave(fmt.tile, dim=1)  # [n, Q] each value's scale
    err = (y[:, :Q] - x[:, :Q]).abs()
    bound = x[:, :Q].abs() * 2.0**-4 + s * 2.0**-10  # half an ulp of 3 mantissa bits; half a subnormal step
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err - bound).max())
    assert torch.equal(y[:, Q:], x[:, Q:].to(torch.bfloat16).float())  # rope values: bf16, not quantized
    if fmt.scale == "fp32":  # decoding and re-encoding changes no byte (a power-of-two scale can shrink: the
        assert torch.equal(fmt32.encode(y), fmt32.encode(x))  # tiers copy bytes, never re-encode; I2 checks it)


# -- kernels on FP8 rows ---------------------------------------------------------------------------
def _mla_case(C: int, R: int, T: int, H: int, k: int, P: int = 6, per: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    fmt = KVFormats.mla("fp8_e4m3", C + R, R, 16, torch.float32).latent
    rows = fmt.encode(torch.randn(P * per, C + R, generator=g)).view(P, per, fmt.width).to(DEV)
    q, qp = torch.randn(T, H, C, generator=g).to(DEV), torch.randn(T, H, R, generator=g).to(DEV)
    loc = torch.randint(0, P * per, (T, k), generator=g).to(DEV)
    if T > 1:
        loc[1, k // 2 :] = -1  # a ragged token
    if T > 2:
        loc[2] = -1  # a padding token
    return fmt, rows, q, qp, loc


@pytest.mark.parametrize("C,R,T,H,k,split", [(32, 8, 3, 5, 37, 0), (32, 8, 4, 3, 70, 16), (128, 16, 2, 16, 33, 32),
                                            (48, 8, 3, 4, 21, 0), (32, 8, 0, 5, 9, 0), (32, 8, 3, 5, 0, 0)])
def test_sparse_mla_kernel_reads_fp8_rows_like_its_reference(C, R, T, H, k, split):
    fmt, rows, q, qp, loc = _mla_case(C, R, T, H, k)
    want = sparse_mla_reference(q, qp, rows, loc, 0.3, fmt)
    got = sm.run_sparse_mla(sm.plan_sparse_mla(H, C, R, split_rows=split), q, qp, rows, loc, 0.3, fmt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the reference is attention over the decoded rows
    torch.testing.assert_close(want, sparse_mla_reference(q, qp, fmt.decode(rows), loc, 0.3), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["gather", "reshape", "select", "fold"])
def test_every_fp8_scale_path_matches_the_reference(mode, monkeypatch):
    """GLM's shape: 512 values in 4 tiles of 128 (fold: scales on per-tile scores and on p)."""
    monkeypatch.setenv("DHISPARSE_FP8_SCALES", mode)
    fmt, rows, q, qp, loc = _mla_case(512, 64, 2, 16, 40, P=2, per=32)
    assert sm._fp8_args(fmt, 512, 64)[4] == {"gather": 0, "reshape": 1, "select": 2, "fold": 3}[mode]
    want = sparse_mla_reference(q, qp, rows, loc, 0.05, fmt)
    for split, wide in ((0, False), (32, False), (64, True)):  # wide: the 64-head x 64-row tile of 16-bit models
        plan = sm.plan_sparse_mla(16, 512, 64, split_rows=split, dtype=torch.bfloat16 if wide else torch.float32,
                                  block_h=64 if wide else None)
        assert plan.wide == wide
        # on the GPU the wide tile fits in shared memory with bf16 queries only (the interpreter takes fp32)
        half = wide and q.is_cuda
        qq, qqp = (q.bfloat16(), qp.bfloat16()) if half else (q, qp)
        got = sm.run_sparse_mla(plan, qq, qqp, rows, loc, 0.05, fmt)
        ref = sparse_mla_reference(qq, qqp, rows, loc, 0.05, fmt) if half else want
        tol = 2e-2 if half else 2e-5
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_sparse_mla_kernel_reads_two_fp8_spaces():
    fmt, rows, q, qp, loc = _mla_case(32, 8, 3, 4, 20)
    stage = rows[:1].reshape(1, -1, fmt.width)[:, :40].contiguous()
    loc2 = loc.clone()
    loc2[0, :5] = (1 << sm.SPACE_BITS) + torch.arange(5, device=loc.device)  # stage rows 0..4
    want = sparse_mla_reference(q, qp, (rows, stage), loc2, 0.3, fmt)
    got = sm.run_sparse_mla(sm.plan_sparse_mla(4, 32, 8), q, qp, (rows, stage), loc2, 0.3, fmt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _index_case(D: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    fmt = KVFormats.mla("fp8_e4m3", 40, 8, D, torch.float32).index
    rows = fmt.encode(torch.randn(5 * 8, D, generator=g)).view(5, 8, fmt.width).to(DEV)
    q, w = torch.randn(6, 4, D, generator=g).to(DEV), torch.randn(6, 4, generator=g).to(DEV)
    locs = torch.randperm(40, generator=g)[:30].view(2, 15).to(DEV)
    tab = IndexTable(rows, locs, torch.tensor([15, 11], device=DEV), fmt)
    pos, req = torch.tensor([3, 8, 14, 2, 9, 10], device=DEV), torch.tensor([0, 0, 0, 1, 1, 1], device=DEV)
    return fmt, tab, q, w, pos, req


def test_indexer_kernels_score_fp8_keys_like_their_reference():
    fmt, tab, q, w, pos, req = _index_case()
    D = fmt.quantized
    split = tab._replace(rows=tab.rows[..., :D].contiguous(), scales=tab.rows[..., D:].contiguous())  # the arena's
    want = indexer_scores_torch(q, w, pos, req, tab)
    plain = indexer_scores_torch(q, w, pos, req, IndexTable(fmt.decode(tab.rows), tab.locs, tab.lens))
    assert torch.equal(want, plain)  # the reference scores the decoded keys
    assert torch.equal(indexer_scores_torch(q, w, pos, req, split), want)
    for group, t in ((1, tab), (3, tab), (1, split), (3, split)):
        got = indexer_scores_triton(q, w, pos, req, t, group=group)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        ok = torch.isfinite(want)
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-5)


def test_fp8_index_keys_are_split_in_the_arena_and_read_back_whole():
    from dhisparse.kv.memory.arena import KVArena
    from dhisparse.models.tiny import tiny_config

    cfg = tiny_config()
    f = KVFormats.mla("fp8_e4m3", cfg.latent_dim, cfg.qk_rope_head_dim, cfg.index_head_dim, torch.float32)
    arena = KVArena(cfg, 3, 4, "cpu", torch.float32, f)
    D, ips, layer = arena.index_split, arena.index_page_size, arena.layout.index_layers[-1]
    assert D == cfg.index_head_dim and f.index.width == D + 4
    keys = f.index.encode(torch.randn(5, D))
    loc = torch.tensor([0, 3, ips, ips + 1, 2 * ips + ips - 1])
    arena.write_index(layer, loc, keys)
    assert torch.equal(arena.read_index(layer, loc), keys)
    vals, scales = arena.index_spaces(layer)
    assert vals.stride(1) == D and torch.equal(vals[1, 0], keys[2, :D]) and torch.equal(scales[1, 1], keys[3, D:])
    region = arena.index_pages[1, arena.index_slot[layer]]  # page 1: values of its ips keys, then their scales
    assert torch.equal(region[:D], keys[2, :D]) and torch.equal(region[ips * D : ips * D + 4], keys[2, D:])



@pytest.mark.parametrize("page_size", [64, 4])
def test_fp8_index_slots_start_16_byte_aligned_at_glm5_shape(page_size):
    """Every index slot of a page starts 16-B aligned, so the indexer kernel's key loads vectorise:
    at GLM-5's shape an unrounded ips (1181 keys of 132 B) put odd slots 4 B off 16 and made FP8
    scoring ~10x slower than bf16 on the H200. (Breakage tried: ips = page_elems // (F * Wi), the
    old rule: this test fails.) bf16 keys keep the old count (256 B each: already aligned)."""
    from dhisparse.kv.memory.arena import KVArena
    from dhisparse.models.scaled import scaled_config

    cfg = scaled_config("glm52-scaled")
    for kv in ("fp8_e4m3", "auto"):
        f = KVFormats.of_model(kv, cfg, torch.bfloat16)
        arena = KVArena(cfg, 2, page_size, "cpu", torch.bfloat16, f)
        F, Wi = len(arena.layout.index_layers), f.index.width
        old = arena.page_elems // (F * Wi)
        assert arena.index_page_size <= old and (kv == "fp8_e4m3" or arena.index_page_size == old)
        for layer in arena.layout.index_layers:
            vals, scales = arena.index_spaces(layer)
            assert vals.data_ptr() % 16 == 0 and vals.stride(0) * vals.element_size() % 16 == 0, (kv, layer)
            if scales is not None:
                assert scales.data_ptr() % 4 == 0

def test_attention_over_fp8_rows_is_close_to_attention_over_the_values():
    fmt, rows, q, qp, loc = _mla_case(128, 16, 4, 8, 48, seed=5)
    vals = torch.randn(rows.shape[0] * rows.shape[1], 144, generator=torch.Generator().manual_seed(5)).to(DEV)
    rows = fmt.encode(vals).view_as(rows)
    want = sparse_mla_reference(q, qp, vals.view(*rows.shape[:2], 144), loc, 144**-0.5)
    got = sparse_mla_reference(q, qp, rows, loc, 144**-0.5, fmt)
    err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)
    assert float(err[:2].max()) < 0.05, err  # e4m3 with per-128 scales: a few percent (tokens 0, 1 attend)


# -- bad settings ----------------------------------------------------------------------------------
def test_bad_kv_cache_dtypes_name_the_flag(monkeypatch):
    with pytest.raises(ConfigValueError, match=r"--kv-cache-dtype.*auto, bfloat16, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "A100")
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8_e4m3 needs .* 8\.9.*A100 has 8\.0"):
        check_device("fp8_e4m3", torch.device("cuda"))
    check_device("auto", torch.device("cuda"))  # plain rows: nothing to check
    with pytest.raises(ValueError, match="multiple of the tile"):
        RowFormat(40, torch.float32, True, 8, 24)


# -- deliberate breakages are caught ---------------------------------------------------------------
def test_breakages_are_caught(monkeypatch):
    fmt = MLA.latent
    with monkeypatch.context() as m:  # a wrong scale (amax / 240)
        m.setattr("dhisparse.core.kvformat.FP8_MAX", 240.0)
        with pytest.raises(AssertionError):
            test_quantizer_matches_a_plain_reference_bit_for_bit(fmt)
    with monkeypatch.context() as m:  # the kernel reads the scales one tile off
        orig = sm._fp8_args
        m.setattr(sm, "_fp8_args", lambda *args: (lambda a: (a[0], a[1] + 4, *a[2:]))(orig(*args)))
        with pytest.raises(AssertionError):
            test_sparse_mla_kernel_reads_fp8_rows_like_its_reference(32, 8, 3, 5, 37, 0)
    with monkeypatch.context() as m:  # decoding forgets the scales
        m.setattr(RowFormat, "scales_of", lambda self, v: torch.ones(*v.shape[:-1], self.tiles))
        with pytest.raises(AssertionError):
            test_round_trip_error_is_within_the_e4m3_bound(fmt)
