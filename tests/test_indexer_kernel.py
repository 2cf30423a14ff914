"""Batched indexer scoring + top-k (Triton kernel and batched PyTorch) against the per-request
`indexer_topk_reference`: exact indices, scores within 1e-5 (TRITON_INTERPRET on CPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hf_fixtures import glm_config  # noqa: E402

from dhisparse.core.batch import KVContext
from dhisparse.kernels.indexer import (  # noqa: E402
    indexer_scores_torch, indexer_scores_triton, indexer_topk_torch, indexer_topk_triton)
from dhisparse.core.rows import gather_rows
from dhisparse.kv.memory.arena import KVArena  # noqa: E402
from dhisparse.core.batch import ForwardBatch, IndexTable  # noqa: E402
from dhisparse.kv.resident.dense import DenseKV  # noqa: E402
from dhisparse.kv.resident.store import PagedContext  # noqa: E402
from dhisparse.layers.indexer import IndexerProjection, indexer_topk, indexer_topk_reference  # noqa: E402
from dhisparse.core.config import ModelConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = ModelConfig.from_hf(glm_config(index_n_heads=16))
LAYER = 4  # a full layer whose index slot is not the first: a strided, offset arena view


def make_table(lens: list[int], dtype=torch.float32, page_size: int = 4, seed: int = 0):
    """Random index keys of requests with `lens` keys each, on shuffled pages of a KVArena."""
    g = torch.Generator().manual_seed(seed)
    arena = KVArena(CFG, 64, page_size, DEV, dtype)
    arena.storage.copy_(torch.randn(arena.storage.shape, generator=g).to(dtype))
    ips = arena.index_page_size
    perm = torch.randperm(64, generator=g).tolist()
    locs = torch.full((len(lens), max(max(lens, default=1), 1)), -1, dtype=torch.int64, device=DEV)
    for r, n in enumerate(lens):
        need = -(-n // ips)
        pages, perm = perm[:need], perm[need:]
        locs[r, :n] = arena.locations(pages, n, ips)
    rows = arena.index_spaces(LAYER)[0]
    assert not rows.is_contiguous()
    return IndexTable(rows, locs, torch.tensor(lens, dtype=torch.int64, device=DEV)), arena


def make_pass(chunks: list[tuple[int, int]], dtype=torch.float32, seed: int = 1):
    """chunks: (n_tokens, start_position) per request -> (batch, projection)."""
    batch = ForwardBatch.build([([0] * n, s) for n, s in chunks], DEV)
    g = torch.Generator().manual_seed(seed)
    T, H, D = batch.num_tokens, CFG.index_n_heads, CFG.index_head_dim
    q = torch.randn(T, H, D, generator=g).to(dtype).to(DEV)
    w = (torch.randn(T, H, generator=g) * H**-0.5).to(DEV)
    return batch, IndexerProjection(q, torch.zeros(T, D, device=DEV), w)


def check(chunks, lens=None, topk=8, dtype=torch.float32, tol=1e-5):
    batch, proj = make_pass(chunks, dtype)
    lens = lens if lens is not None else batch.seq_lens.tolist()
    table, _ = make_table(lens, dtype)
    args = (proj.q, proj.w, batch.positions, batch.req_idx, table)
    keys_of = lambda r: gather_rows(table.rows, table.locs[r, : lens[r]])  # noqa: E731
    want = indexer_topk_reference(proj, batch.positions, batch.query_start, keys_of, topk)
    got_torch, got_tri = indexer_topk_torch(*args, topk), indexer_topk_triton(*args, topk)
    assert got_torch.shape == got_tri.shape == (batch.num_tokens, topk)
    assert torch.equal(got_torch.cpu(), want.cpu()), (got_torch, want)
    assert torch.equal(got_tri.cpu(), want.cpu()), (got_tri, want)
    s_torch, s_tri = indexer_scores_torch(*args), indexer_scores_triton(*args)
    assert torch.equal(torch.isinf(s_torch), torch.isinf(s_tri))
    fin = ~torch.isinf(s_torch)
    torch.testing.assert_close(s_tri[fin], s_torch[fin], rtol=tol, atol=tol)
    return want


def test_decode_ragged():
    lens = [37, 5, 130, 64, 1]
    check([(1, n - 1) for n in lens])


def test_single_decode_token():
    sel = check([(1, 99)])
    assert (sel >= 0).all() and sel.max() <= 99


def test_verification_tokens_causal():
    # request 0 verifies K=4 tokens at positions 60..63, each sees a different prefix
    sel = check([(4, 60), (1, 20), (3, 7)], topk=16)
    for i, pos in enumerate(range(60, 64)):
        assert sel[i].max() <= pos


def test_prefill_chunk_not_at_zero():
    check([(16, 20), (9, 0), (5, 123)], topk=12)


def test_short_histories_pad_with_minus_one():
    sel = check([(1, 2), (3, 0), (1, 9)], topk=32)
    assert (sel[0, 3:] == -1).all() and (sel[0, :3] >= 0).all()
    assert (sel[1, 1:] == -1).all() and (sel[2, 3:] == -1).all() and (sel[3, 10:] == -1).all()


def test_keys_past_the_pass_are_not_visible():
    # lens longer than seq_lens (e.g. stale rows of rejected drafts): masked by position
    check([(2, 10), (1, 4)], lens=[40, 30], topk=16)


def test_empty_batch():
    batch, proj = make_pass([])
    table, _ = make_table([])
    for fn in (indexer_topk_torch, indexer_topk_triton):
        out = fn(proj.q, proj.w, batch.positions, batch.req_idx, table, 8)
        assert out.shape == (0, 8) and out.dtype == torch.int64


@pytest.mark.skipif(DEV != "cuda", reason="16-bit tensor-core dot path: CUDA only")
def test_bf16_keys():
    check([(1, 200), (4, 50)], dtype=torch.bfloat16, tol=1e-2)


def test_paged_context_table_matches_index_keys():
    table, arena = make_table([12, 30])
    batch = ForwardBatch.build([([0], 11), ([0, 0], 28)], DEV)
    ctx = PagedContext(type("KV", (), {"arena": arena, "device": torch.device(DEV)})(), batch, 2)
    ctx.idx_of = torch.full((2, 30), -1, dtype=torch.int64, device=DEV)
    ctx.idx_of[:, : table.locs.shape[1]] = table.locs
    t = ctx.index_table(LAYER)
    for r in range(2):
        n = int(t.lens[r])
        assert torch.equal(gather_rows(t.rows, t.locs[r, :n]), ctx.index_keys(LAYER, r))


def test_dense_table_and_dispatch():
    dense = DenseKV(CFG, DEV)
    g = torch.Generator().manual_seed(3)
    first = ForwardBatch.build([([0] * 20, 0), ([0] * 7, 0), ([0] * 33, 0)], DEV)
    dense.begin(first, [5, 2, 9]).store(LAYER, torch.zeros(60, CFG.latent_dim, device=DEV),
                                        torch.randn(60, CFG.index_head_dim, generator=g).to(DEV))
    batch, proj = make_pass([(1, 20), (3, 7), (1, 33)])
    dense.begin(batch, [5, 2, 9]).store(LAYER, torch.zeros(5, CFG.latent_dim, device=DEV),
                                        torch.randn(5, CFG.index_head_dim, generator=g).to(DEV))
    table = dense.index_table(LAYER)
    for r in range(3):
        n = int(table.lens[r])
        assert n == int(batch.seq_lens[r])
        assert torch.equal(gather_rows(table.rows, table.locs[r, :n]), dense.index_keys(LAYER, r))
    want = indexer_topk_reference(proj, batch.positions, batch.query_start, lambda r: dense.index_keys(LAYER, r), 8)
    assert torch.equal(indexer_topk(proj, batch, dense, LAYER, 8), want)

    class KeysOnly(KVContext):  # a context whose index_table is the default None: the per-request fallback
        index_keys = dense.index_keys

    assert torch.equal(indexer_topk(proj, batch, KeysOnly(), LAYER, 8), want)


@pytest.mark.parametrize("K,starts,lens_cut", [(2, [60, 20, 7], 0), (3, [9, 0, 40], 5), (4, [1, 33], 0),
                                               (5, [0, 12, 70, 3], 2)])
def test_grouped_scores_match_the_per_token_scores(K, starts, lens_cut):
    """Grouped scoring (one key read for a request's K queries): same visibility, same scores
    (1e-5), same top-k as the torch path; a padded token (position -1) sees nothing; a request
    whose keys end before its queries' positions (lens_cut) is cut at its length."""
    batch, proj = make_pass([(K, s) for s in starts])
    assert batch.tokens_per_request == K
    lens = [max(1, n - lens_cut) for n in batch.seq_lens.tolist()]
    table, _ = make_table(lens)
    pos = batch.positions.clone()
    pos[K - 1] = -1  # the first request's last token is padding
    args = (proj.q, proj.w, pos, batch.req_idx, table)
    s_torch, s_grp = indexer_scores_torch(*args), indexer_scores_triton(*args, group=K)
    assert torch.isinf(s_grp[K - 1]).all()
    assert torch.equal(torch.isinf(s_torch), torch.isinf(s_grp))
    fin = ~torch.isinf(s_torch)
    torch.testing.assert_close(s_grp[fin], s_torch[fin], rtol=1e-5, atol=1e-5)
    assert torch.equal(indexer_topk_triton(*args, 8, group=K).cpu(), indexer_topk_torch(*args, 8).cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 4, 5])
def test_grouped_scores_equal_the_per_token_kernels_bit_for_bit(K, dtype):
    """A verification round (grouped) must select what decoding (per token) selects: the two
    kernels' scores are bitwise equal, in the engine's bf16 on the GPU. (The interpreter's bf16
    tl.dot is not the GPU's: bf16 runs on CUDA only.)"""
    if dtype == torch.bfloat16 and DEV != "cuda":
        pytest.skip("bf16 kernel arithmetic is checked on the GPU")
    batch, proj = make_pass([(K, s) for s in (0, 37, 90, 5)], dtype)
    table, _ = make_table(batch.seq_lens.tolist(), dtype)
    args = (proj.q, proj.w, batch.positions, batch.req_idx, table)
    per_token, grouped = indexer_scores_triton(*args), indexer_scores_triton(*args, group=K)
    assert torch.equal(per_token, grouped)


def test_grouped_scoring_rejects_a_ragged_pass():
    batch, proj = make_pass([(3, 10), (2, 4)])
    assert batch.tokens_per_request == 0
    table, _ = make_table(batch.seq_lens.tolist())
    with pytest.raises(ValueError, match="multiple of group"):
        indexer_scores_triton(proj.q, proj.w, batch.positions, batch.req_idx, table, group=2)


def test_prefill_sized_groups_use_the_per_token_kernel(monkeypatch):
    """A prefill chunk is one request's many tokens (tokens_per_request = the chunk): its group is
    above MAX_GROUP and must go to the per-token kernel (the grouped kernel's query tile would pass
    Triton's block limit on the GPU: 8K prefill hit 2^23 elements)."""
    import dhisparse.kernels.indexer as ik

    K = ik.MAX_GROUP + 1
    batch, proj = make_pass([(K, 30)])
    table, _ = make_table(batch.seq_lens.tolist())
    args = (proj.q, proj.w, batch.positions, batch.req_idx, table)
    want = indexer_scores_triton(*args)

    class NoGroup:
        def __getitem__(self, grid):
            raise AssertionError("grouped kernel launched for a prefill-sized group")

    monkeypatch.setattr(ik, "indexer_score_group_kernel", NoGroup())
    assert torch.equal(indexer_scores_triton(*args, group=K), want)
    assert torch.equal(indexer_topk_triton(*args, 8, group=K).cpu(), indexer_topk_torch(*args, 8).cpu())
