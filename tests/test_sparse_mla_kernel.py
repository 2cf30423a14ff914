"""Triton sparse-MLA decode / verify kernel against `sparse_mla_reference` (interpreter on CPU):
ragged and empty shapes, one and two row spaces, strided arena views, bf16, the dispatcher and
the tiny model end to end with the kernel forced on."""

from __future__ import annotations

import pytest
import torch

import dhisparse.kernels.sparse_mla as sm
from dhisparse.kernels import backend as kernel_backend
from dhisparse.kernels.backend import KernelSettings
from dhisparse.kernels.sparse_mla import plan_sparse_mla, run_sparse_mla, sparse_mla, sparse_mla_triton
from dhisparse.core.rows import SPACE
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kernels.sparse_mla_ref import sparse_mla_reference
from dhisparse.models.tiny import build_tiny

DEV = "cuda" if torch.cuda.is_available() else "cpu"
cpu_model = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model needs the interpreter; GPU engine tests cover it")


def _inputs(T, H, C, R, k, n_rows, dtype=torch.float32, drop=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, C, generator=g).to(DEV, dtype)
    qp = torch.randn(T, H, R, generator=g).to(DEV, dtype)
    loc = torch.randint(0, n_rows, (T, k), generator=g)
    loc[torch.rand(T, k, generator=g) < drop] = -1
    return q, qp, loc.to(DEV)


def _check(q, qp, rows, loc, scale=0.37, tol=None):
    got = sparse_mla_triton(q, qp, rows, loc, scale)
    want = sparse_mla_reference(q, qp, rows, loc, scale)
    assert got.shape == want.shape and got.dtype == q.dtype
    rtol, atol = tol or ((1e-5, 1e-5) if q.dtype == torch.float32 else (2e-2, 2e-2))
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    return got


@pytest.mark.parametrize("T,H,C,R,k,per_page", [(3, 5, 48, 6, 37, 4), (4, 1, 32, 8, 16, 16), (2, 4, 32, 8, 70, 3),
                                                  (1, 17, 40, 8, 5, 1)])
def test_one_space_ragged_shapes(T, H, C, R, k, per_page):
    P = 9
    rows = torch.randn(P, per_page, C + R).to(DEV)
    q, qp, loc = _inputs(T, H, C, R, k, P * per_page)
    loc[0] = -1  # a token with no valid location -> zeros
    if T > 1:
        loc[1, 1:] = -1  # a single valid row -> that row's c exactly
    out = _check(q, qp, rows, loc)
    assert out[0].abs().max() == 0
    if T > 1 and loc[1, 0] >= 0:
        r = int(loc[1, 0])
        torch.testing.assert_close(out[1], rows[r // per_page, r % per_page, :C].expand(H, C))


def test_empty_and_all_skipped():
    C, R = 32, 8
    rows = torch.randn(4, 4, C + R).to(DEV)
    q, qp, loc = _inputs(0, 3, C, R, 8, 16)
    assert sparse_mla_triton(q, qp, rows, loc, 0.5).shape == (0, 3, C)
    q, qp, loc = _inputs(3, 3, C, R, 8, 16)
    assert (sparse_mla_triton(q, qp, rows, torch.full_like(loc, -1), 0.5) == 0).all()
    assert (sparse_mla_triton(q, qp, rows, loc[:, :0], 0.5) == 0).all()  # k = 0
    _check(q, qp, rows, loc, tol=None)


def test_two_spaces_staging():
    C, R, P, per = 48, 6, 5, 4
    pages = torch.randn(P, per, C + R).to(DEV)
    stage = torch.randn(1, 23, C + R).to(DEV)
    q, qp, loc = _inputs(4, 5, C, R, 40, P * per, drop=0.2)
    g = torch.Generator().manual_seed(3)
    staged = (torch.rand(loc.shape, generator=g) < 0.5).to(DEV) & (loc >= 0)
    loc = torch.where(staged, SPACE + torch.randint(0, 23, loc.shape, generator=g).to(DEV), loc)
    loc[2] = -1
    _check(q, qp, (pages, stage), loc)
    only_stage = torch.where(loc >= 0, SPACE + loc % 23, loc)
    _check(q, qp, (pages, stage), only_stage)


def test_strided_arena_view_and_layers():
    lm = build_tiny()
    cfg = lm.config
    arena = KVArena(cfg, num_pages=6, page_size=4, device=DEV, dtype=torch.float32)
    arena.storage.normal_()
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    for layer in (0, cfg.num_layers - 1):
        rows = arena.latent[:, layer]
        assert not rows.is_contiguous()
        q, qp, loc = _inputs(3, cfg.num_heads, C, R, cfg.index_topk, 6 * 4, seed=layer)
        got = _check(q, qp, rows, loc)
        torch.testing.assert_close(got, sparse_mla_reference(q, qp, rows.contiguous(), loc, 0.37), rtol=1e-5, atol=1e-5)
    stage = torch.randn(1, 10, C + R).to(DEV)
    loc2 = torch.where(loc % 2 == 0, loc, SPACE + loc % 10)
    _check(q, qp, (arena.latent[:, 2], stage), loc2)


@pytest.mark.parametrize("H", [1, 5])
def test_bf16(H):
    C, R, P, per = 48, 6, 6, 4
    rows = torch.randn(P, per, C + R).to(DEV, torch.bfloat16)
    q, qp, loc = _inputs(3, H, C, R, 33, P * per, dtype=torch.bfloat16)
    q = q * 0.2  # keep logits moderate so the bf16 probabilities stay informative
    _check(q, qp, rows, loc)


def test_plan_blocks_and_strided_queries():
    C, R, H = 32, 8, 5
    rows = torch.randn(4, 8, C + R).to(DEV)
    big_q = torch.randn(3, 2 * H, C + 4).to(DEV)
    q = big_q[:, ::2, 2 : 2 + C]  # strided heads, offset columns
    qp = torch.randn(3, H, 2 * R).to(DEV)[..., ::2]  # non-unit last stride -> copied
    _, _, loc = _inputs(3, H, C, R, 50, 32)
    want = sparse_mla_reference(q, qp, rows, loc, 0.2)
    for bh, bk in ((16, 16), (32, 64)):
        got = run_sparse_mla(plan_sparse_mla(H, C, R, block_h=bh, block_k=bk), q, qp, rows, loc, 0.2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        run_sparse_mla(plan_sparse_mla(H + 1, C, R), q, qp, rows, loc, 0.2)
    with pytest.raises(ValueError):
        run_sparse_mla(plan_sparse_mla(H, C, R), q, qp, rows[..., :-1], loc, 0.2)


def test_dispatcher_backend(monkeypatch):
    cpu = torch.zeros(1)
    assert sm.backend(cpu) == "torch"
    C, R = 32, 8
    rows = torch.randn(2, 4, C + R)
    q, qp, loc = (t.cpu() for t in _inputs(2, 3, C, R, 6, 8))
    torch.testing.assert_close(sparse_mla(q, qp, rows, loc, 0.3), sparse_mla_reference(q, qp, rows, loc, 0.3))
    if torch.cuda.is_available():
        assert sm.backend(q.cuda()) == "triton"
        kernel_backend.configure(KernelSettings("torch"))  # the conftest restores the default
        assert sm.backend(q.cuda()) == "torch"


def _force_triton(monkeypatch) -> list:
    """Route the dispatcher to the kernel on CPU; returns the row spaces it was called with."""
    calls = []
    orig = sm.sparse_mla_triton

    def traced(q_abs, q_pe, rows, loc, scale, fmt=None):
        calls.append(rows)
        return orig(q_abs, q_pe, rows, loc, scale, fmt)

    kernel_backend.configure(KernelSettings("triton"))  # the conftest restores the default
    monkeypatch.setenv("DHISPARSE_TRITON_KERNELS", "1")  # engines built after this read it
    monkeypatch.setattr(sm, "sparse_mla_triton", traced)
    return calls


def _model_logits(lm, prompt, steps):
    from dhisparse.core.batch import ForwardBatch
    from dhisparse.kv.resident.dense import DenseKV

    kv = DenseKV(lm.config)
    outs = []
    with torch.no_grad():
        batch = ForwardBatch.build([(list(prompt), 0), (list(prompt[:20]), 0)])
        hid = lm.model(batch, kv.begin(batch, [0, 1])).hidden
        outs.append(lm.model.logits(hid))
        for s in range(steps):  # two requests; request 0 verifies 3 tokens at once
            toks = [int(outs[-1][-1].argmax())] * 3
            batch = ForwardBatch.build([(toks, len(prompt) + 3 * s), (toks[:1], 20 + s)])
            hid = lm.model(batch, kv.begin(batch, [0, 1])).hidden
            outs.append(lm.model.logits(hid))
    return outs


@cpu_model
def test_tiny_model_logits_match_with_triton_forced(monkeypatch):
    lm = build_tiny()
    prompt = [3 + (7 * j) % 250 for j in range(37)]  # past index_topk: sparse selection
    want = _model_logits(lm, prompt, 3)
    calls = _force_triton(monkeypatch)
    got = _model_logits(lm, prompt, 3)
    assert len(calls) == 4 * lm.config.num_layers
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@cpu_model
def test_engine_staging_tokens_match_with_triton_forced(monkeypatch):
    """hisparse + oracle speculation with a 16-row hot cache: verification unions overflow into the
    staging arena, so the kernel reads (arena layer view, staging) row-space pairs."""
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.llm import LLM

    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(20 + 23 * i)] for i in range(2)]
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, LLM("tiny").generate(prompts, sp))}

    def spec_llm() -> LLM:
        llm = LLM.__new__(LLM)
        llm.engine = Engine(EngineConfig(preset="hisparse", hot_cache_rows=16, page_size=4, speculative_algorithm="oracle",
                                         speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=3.0),
                            oracle_reference=ref)
        return llm

    want = [o.token_ids for o in spec_llm().generate(prompts, sp)]
    calls = _force_triton(monkeypatch)
    llm = spec_llm()
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want == [ref[tuple(p)] for p in prompts]
    assert llm.engine.stats().as_dict()["resolver_overflow"] > 0
    assert any(isinstance(r, tuple) and not r[0].is_contiguous() for r in calls)  # (arena layer view, staging)


@pytest.mark.parametrize("T,H,C,R,k,split", [(3, 5, 48, 6, 37, 16), (2, 4, 32, 8, 70, 16), (4, 17, 40, 8, 33, 32),
                                              (1, 3, 32, 8, 16, 16), (2, 2, 32, 8, 100, 48)])
def test_split_rows_match_the_reference(T, H, C, R, k, split):
    """Split k locations over several programs + the combine: the reference's result, including a
    token with no valid row (zeros), one whose only valid rows sit in one chunk, and k <= split
    (no split at all); one and two row spaces."""
    P, per = 7, 4
    rows = torch.randn(P, per, C + R).to(DEV)
    stage = torch.randn(1, 40, C + R).to(DEV)
    q, qp, loc = _inputs(T, H, C, R, k, P * per, seed=k)
    loc[0] = -1
    if T > 1:
        loc[1, : min(k, split)] = -1  # the first chunk has nothing valid
    plan = plan_sparse_mla(H, C, R, split_rows=split)
    assert plan.split_rows % plan.block_k == 0 and plan.split_rows >= split
    want = sparse_mla_reference(q, qp, rows, loc, 0.37)
    got = run_sparse_mla(plan, q, qp, rows, loc, 0.37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[0].abs().max() == 0
    loc2 = torch.where(torch.rand(loc.shape, device=loc.device) < 0.5, loc, SPACE + (loc.clamp(min=0) % 40))
    loc2[loc < 0] = -1
    torch.testing.assert_close(run_sparse_mla(plan, q, qp, (rows, stage), loc2, 0.37),
                               sparse_mla_reference(q, qp, (rows, stage), loc2, 0.37), rtol=1e-5, atol=1e-5)


def test_split_rows_do_not_depend_on_the_batch():
    """A token's output is bitwise the same alone and inside a larger batch (verification passes
    must reproduce decoding)."""
    C, R, H, k = 32, 8, 4, 64
    rows = torch.randn(6, 4, C + R).to(DEV)
    q, qp, loc = _inputs(5, H, C, R, k, 24)
    plan = plan_sparse_mla(H, C, R, split_rows=16)
    full = run_sparse_mla(plan, q, qp, rows, loc, 0.5)
    for t in range(5):
        one = run_sparse_mla(plan, q[t : t + 1], qp[t : t + 1], rows, loc[t : t + 1], 0.5)
        assert torch.equal(one[0], full[t])


@pytest.mark.parametrize("C", [48, 40])
def test_combine_column_blocks_are_bitwise_the_same(monkeypatch, C):
    """The combine's column blocks (COMBINE_COLUMNS) change parallelism, not arithmetic: 16-column
    blocks over a ragged C give the one-block output bit for bit, and the reference's result.
    (Breakage tried: the column offset `program_id(2) * BC` dropped; caught here.)"""
    R, H, k = 8, 5, 70
    rows = torch.randn(6, 4, C + R).to(DEV)
    q, qp, loc = _inputs(4, H, C, R, k, 24, seed=7)
    plan = plan_sparse_mla(H, C, R, split_rows=16)
    monkeypatch.setattr(sm, "COMBINE_COLUMNS", 64)  # one block covers C
    whole = run_sparse_mla(plan, q, qp, rows, loc, 0.5)
    monkeypatch.setattr(sm, "COMBINE_COLUMNS", 16)
    got = run_sparse_mla(plan, q, qp, rows, loc, 0.5)
    assert torch.equal(got, whole)
    torch.testing.assert_close(got, sparse_mla_reference(q, qp, rows, loc, 0.5), rtol=1e-5, atol=1e-5)


def test_combine_head_blocks_are_bitwise_the_same(monkeypatch):
    """The combine takes COMBINE_HEADS heads a program whatever the split tile's block_h: the wide
    tile's partials (64 heads a program) merged 16 or 64 heads at a time give the same bits, over
    a ragged head count (masked heads) and the reference's result. (Breakage tried: the head
    offset `hb * BLOCK_H` dropped; caught here.)"""
    C, R, H, k = 288, 8, 40, 150
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    rows = torch.randn(6, 32, C + R).to(DEV, dtype)
    q, qp, loc = _inputs(3, H, C, R, k, 192, dtype=dtype, seed=11)
    plan = plan_sparse_mla(H, C, R, split_rows=64, dtype=torch.bfloat16)
    assert plan.wide and plan.block_h == 64
    monkeypatch.setattr(sm, "COMBINE_HEADS", 64)
    whole = run_sparse_mla(plan, q, qp, rows, loc, 0.2)
    monkeypatch.setattr(sm, "COMBINE_HEADS", 16)
    got = run_sparse_mla(plan, q, qp, rows, loc, 0.2)
    assert torch.equal(got, whole)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), sparse_mla_reference(q, qp, rows, loc, 0.2).float(), rtol=tol, atol=tol)


def test_split_rows_in_token_chunks_are_bitwise_the_same(monkeypatch):
    """A pass whose split-rows workspace would exceed SPLIT_WORKSPACE_BYTES (a GLM-5 prefill chunk)
    runs in token chunks: the output is bitwise the one-launch output, ragged last chunk included.
    (Breakage tried: the chunk loop writing every chunk to out[:Tc] fails this test.)"""
    C, R, H, k = 32, 8, 4, 64
    rows = torch.randn(6, 4, C + R).to(DEV)
    q, qp, loc = _inputs(7, H, C, R, k, 24, seed=4)
    plan = plan_sparse_mla(H, C, R, split_rows=16)
    whole = run_sparse_mla(plan, q, qp, rows, loc, 0.5)
    per_token = 4 * H * (C + 2) * 4  # S = 4 chunks of 16 rows
    monkeypatch.setattr(sm, "SPLIT_WORKSPACE_BYTES", 3 * per_token)  # chunks of 3, 3, 1 tokens
    assert torch.equal(run_sparse_mla(plan, q, qp, rows, loc, 0.5), whole)


def test_wide_plan_for_many_heads_at_a_large_latent():
    """C > 256 with 16-bit queries: up to 64 heads a program, 64 rows a block, one stage (the
    row tile is gathered once for all of them); fp32 queries and 16-head models keep 16 x 32."""
    wide = plan_sparse_mla(64, 512, 64, dtype=torch.bfloat16)
    assert (wide.block_h, wide.block_k, wide.num_warps, wide.num_stages) == (64, 64, 8, 1)
    assert wide.split_rows % wide.block_k == 0
    assert plan_sparse_mla(128, 512, 64).block_h == 64
    for plan in (plan_sparse_mla(64, 512, 64, dtype=torch.float32), plan_sparse_mla(16, 512, 64, dtype=torch.bfloat16)):
        assert (plan.block_h, plan.block_k, plan.num_warps, plan.num_stages) == (16, 32, 8, 2)
    assert plan_sparse_mla(5, 32, 8).block_h == 16 and plan_sparse_mla(5, 32, 8).block_k == 16


@pytest.mark.parametrize("split", [0, 64])
def test_wide_tile_masks_heads_rows_and_columns(split):
    """The wide tile (64 heads x 64 rows) on 33 heads (31 masked), C 288 (padded to 512 columns),
    k 150 (a ragged last block) with skipped locations, whole and split: equals the reference."""
    C, R, H, k = 288, 8, 33, 150
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32  # the interpreter has no shared-memory bound
    rows = torch.randn(8, 32, C + R).to(DEV, dtype)
    q, qp, loc = _inputs(3, H, C, R, k, 256, dtype=dtype, seed=9)
    plan = plan_sparse_mla(H, C, R, split_rows=split, dtype=torch.bfloat16)
    assert (plan.block_h, plan.block_k, plan.wide) == (64, 64, True)
    got = run_sparse_mla(plan, q, qp, rows, loc, 0.1)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), sparse_mla_reference(q, qp, rows, loc, 0.1).float(), rtol=tol, atol=tol)


def test_a_wide_plan_refuses_fp32_queries_on_the_gpu(monkeypatch):
    """The wide tile with fp32 queries needs ~280 KB of shared memory (over the H200's 227 KB):
    run_sparse_mla names q_abs and the fix instead of failing inside Triton; fp32 plans stay narrow."""
    q, qp, loc = _inputs(2, 64, 512, 64, 40, 64)
    rows = torch.randn(2, 32, 576).to(DEV)
    monkeypatch.setattr(sm, "_interpreting", lambda: False)  # the check is the GPU's, before any launch
    with pytest.raises(ValueError, match="q_abs.*dtype=torch.float32"):
        run_sparse_mla(plan_sparse_mla(64, 512, 64, dtype=torch.bfloat16), q, qp, rows, loc, 0.1)
    assert not plan_sparse_mla(64, 512, 64, dtype=torch.float32).wide


@pytest.mark.skipif(DEV != "cuda", reason="the engine's shape and bf16 on the GPU")
@pytest.mark.parametrize("H", [16, 64])
def test_default_plan_is_batch_invariant_at_the_scaled_models_shape(H):
    """The shipped plan (split rows on) at the scaled GLM's shape (16 heads) and glm5-faithful's
    (64: the wide tile) in bf16: a decode pass of 18 tokens and a 72-token verification pass give
    each token bitwise the output it gets alone."""
    C, R, k = 512, 64, 2048  # glm5-faithful's k: 16 splits of 128 rows on the narrow tile, 4 of 512 on the wide
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 64, C + R, generator=g).to(DEV, torch.bfloat16)
    q = torch.randn(72, H, C, generator=g).to(DEV, torch.bfloat16)
    qp = torch.randn(72, H, R, generator=g).to(DEV, torch.bfloat16)
    loc = torch.randint(0, 64 * 64, (72, k), generator=g).to(DEV)
    loc[5, 700:] = -1  # a ragged token: one split ends inside it, the splits after it are empty
    plan = plan_sparse_mla(H, C, R)
    assert 0 < plan.split_rows < k
    full = run_sparse_mla(plan, q, qp, rows, loc, C**-0.5)
    decode = run_sparse_mla(plan, q[::4], qp[::4], rows, loc[::4], C**-0.5)
    assert torch.equal(decode, full[::4])
    for t in (0, 5, 71):
        assert torch.equal(run_sparse_mla(plan, q[t : t + 1], qp[t : t + 1], rows, loc[t : t + 1], C**-0.5)[0], full[t])


def test_default_split_follows_the_tile_and_a_setting_overrides_it():
    """No setting: 128 rows on the narrow tile (16 heads, or fp32 queries at 64), 512 on the wide one
    (64 heads of 16-bit queries); a configured split serves every tile; the split depends on the
    model's shape only, never on the batch."""
    from dhisparse.kernels.backend import DEFAULT_SPLIT_ROWS, WIDE_SPLIT_ROWS

    assert (DEFAULT_SPLIT_ROWS, WIDE_SPLIT_ROWS) == (128, 512)
    assert plan_sparse_mla(16, 512, 64).split_rows == 128 and not plan_sparse_mla(16, 512, 64).wide
    assert plan_sparse_mla(64, 512, 64).split_rows == 512 and plan_sparse_mla(64, 512, 64).wide
    assert plan_sparse_mla(64, 512, 64, dtype=torch.float32).split_rows == 128
    kernel_backend.configure(KernelSettings(mla_split_rows=256))  # the conftest restores the default
    assert plan_sparse_mla(16, 512, 64).split_rows == plan_sparse_mla(64, 512, 64).split_rows == 256
    kernel_backend.configure(KernelSettings(mla_split_rows=0))
    assert plan_sparse_mla(64, 512, 64).split_rows == 0
    with pytest.raises(ValueError, match="mla_split_rows"):
        KernelSettings(mla_split_rows=-1)


def test_split_rows_must_not_be_negative():
    with pytest.raises(ValueError, match="split_rows"):
        plan_sparse_mla(4, 32, 8, split_rows=-1)


@cpu_model
def test_speculation_with_grouped_indexer_scoring_stays_exact(monkeypatch):
    """hisparse + oracle speculation with every kernel in Triton (interpreter) and verification
    queries scored K per key read (kernels/indexer.py grouped scoring): tokens equal resident's,
    verification passes ran grouped and decode passes per token. (Split-row attention cannot
    split the tiny model's k = 16 locations below its 16-row blocks: its tests are above.)"""
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.llm import LLM
    from dhisparse.kernels import indexer as ix

    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(40 + 9 * i)] for i in range(2)]
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, LLM("tiny").generate(prompts, sp))}
    monkeypatch.setenv("DHISPARSE_TRITON_KERNELS", "1")
    monkeypatch.setenv("DHISPARSE_INDEXER_GROUP", "1")
    groups = []
    orig = ix.indexer_scores_triton
    monkeypatch.setattr(ix, "indexer_scores_triton", lambda *a, **k: groups.append(k.get("group", 1)) or orig(*a, **k))
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(preset="hisparse", hot_cache_rows=16, page_size=4, speculative_algorithm="oracle",
                                     speculative_num_draft_tokens=3, speculative_oracle_tokens_per_round=2.0),
                        oracle_reference=ref)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == [ref[tuple(p)] for p in prompts]
    assert 3 in groups and 1 in groups
