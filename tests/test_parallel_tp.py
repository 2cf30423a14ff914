"""Tensor parallelism alone (`--tp-size 2`, gloo, CPU processes, fp64): the layout and its refusals,
each sharded block against the full one in one process (the ranks' sum simulated by threads that
meet at every sum, `in_threads`), TP2 greedy tokens equal to one process on every preset with the
row checker (I2) and a same-routing check on every rank, the serving surface (prefix, abort,
unseeded sampling), and the batch check.

Breakages tried by hand, each failing the tests named:
  - o_proj not summed (`shard_attention` without the `Summed` wrap): the sharded attention and
    sharded model tests, every TP2 token test and the serving-surface test;
  - the indexer's top-k taken before the sum (`indexer_topk_summed` without `reduce`, both
    paths): the sharded indexer tests (both paths), the sharded attention and sharded model tests,
    every TP2 token test and the serving-surface test;
  - the expert halves split inconsistently (shard r's gate rows with shard 1 - r's up rows in
    `layers/tp.shard_experts`): the sharded MoE test and the sharded model test (the tiny model's
    greedy tokens happen to survive it: its routed experts are a small term);
  - a rank dropping a request (`dist_hooks.drop_request_on_rank1`) with the batch check
    (`engine/launch.guard_batches`) not installed: the drop test (rank 0 then sees an unrelated
    "lost during gather" after the mismatched sums' shapes broke rank 1; equal shapes would give
    wrong tokens silently). With the check: RankLost naming the batch check at the first step.
  - (the routing check) rank 1's router bias perturbed in `dist_hooks.same_routing`: the TP2
    token test fails with "the ranks routed differently".
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from dhisparse import LLM
from dhisparse.core.batch import ForwardBatch
from dhisparse.core.parallel import ParallelConfig, ParallelConfigError, RankLost
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.launch import build, tp_engine_config
from dhisparse.kv.resident.dense import DenseKV
from dhisparse.layers.indexer import reference_scores
from dhisparse.layers.moe import MLP, MoE
from dhisparse.layers.rope import RopeTables
from dhisparse.layers.tp import block, set_reduce, shard_attention, shard_indexer, shard_mlp, shard_moe, shard_tensor_parallel
from dhisparse.kernels.indexer_torch import topk_of_scores
from dhisparse.models.tiny import build_tiny, tiny_config
from dist_hooks import generate_on, one_process_tokens, world_presets

PROMPTS = [[5 + (3 * i + j) % 90 for j in range(12 + 11 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
TP = dict(dtype="float64", device="cpu", tp_size=2, dist_timeout_s=20.0, kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20)


def test_layout_of_tensor_parallelism_alone_and_its_refusals():
    pc = ParallelConfig(tp_size=2)
    assert pc.world_size == 2 and pc.tensor_parallel and not pc.expert_parallel and pc.distributed
    assert EngineConfig(tp_size=4).parallel_config().tensor_parallel
    assert not ParallelConfig(tp_size=2, dp_size=2, ep_size=2, enable_dp_attention=True).tensor_parallel
    for kw, flag in [(dict(tp_size=2, dp_size=2), "--tp-size 2 with --dp-size 2"),
                     (dict(tp_size=2, ep_size=2), "--enable-dp-attention")]:
        with pytest.raises(ParallelConfigError, match=flag):
            ParallelConfig(**kw)
    for kw in (dict(speculative_algorithm="dspark"), dict(preset="adaptive+spec", speculative_policy="online")):
        with pytest.raises(ParallelConfigError, match="--tp-size 2: DSpark widths and the online width policy"):
            tp_engine_config(EngineConfig(tp_size=2, **kw))
    cfg = tp_engine_config(EngineConfig(tp_size=2, load_stream="side"))
    assert (cfg.admission_lookahead, cfg.load_stream) == (0, "compute")  # no scheduler input reads a clock


def test_sizes_that_do_not_divide_and_deepseek_v4_are_refused_naming_tp_size():
    from v4_engine_util import loaded_v41

    lm = build_tiny(dtype=torch.float64).model
    shape = lm.model.layers[0].self_attn.q_b_proj.weight.shape
    with pytest.raises(ParallelConfigError, match="--tp-size 3 must divide the model's 4 attention heads"):
        shard_tensor_parallel(lm, 0, 3)
    assert lm.model.layers[0].self_attn.q_b_proj.weight.shape == shape  # checked before anything is cut
    with pytest.raises(ParallelConfigError, match="--tp-size 4 must divide the model's 30 MoE expert intermediate"):
        block(30, 0, 4, "MoE expert intermediate size")
    with pytest.raises(ParallelConfigError, match="--tp-size 2: .*DeepSeek-V4"):
        shard_tensor_parallel(loaded_v41().model, 0, 2)
    assert shard_tensor_parallel(lm, 1, 2) == 6


def in_threads(world: int, fn):
    """fn(rank, reduce) for every rank at once, one thread each; `reduce` is the ranks' sum in rank
    order (core.parallel.tp_sum simulated in one process: every rank blocks until all deposited).
    Returns the results by rank."""
    barrier = threading.Barrier(world, timeout=60)
    parts, out, errors = [None] * world, [None] * world, []

    def reduce_for(rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            parts[rank] = x
            barrier.wait()
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            barrier.wait()
            return total
        return reduce

    def run(rank: int) -> None:
        try:
            with torch.inference_mode():
                out[rank] = fn(rank, reduce_for(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in threads], [t.join() for t in threads]
    if errors:
        raise errors[0]
    return out


def _random(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = module.double()
    for p in module.parameters():
        p.data.normal_(0, 0.05)
    return module


def _shards(full: torch.nn.Module, shard, world: int = 2) -> list:
    shards = [copy.deepcopy(full) for _ in range(world)]
    for r, m in enumerate(shards):
        shard(m, r, world)
    return shards


def test_sharded_mlp_and_moe_sum_to_the_full_block_with_the_same_routing_on_every_rank():
    x = torch.randn(40, 64, dtype=torch.float64)
    mlp = _random(MLP(64, 128))
    with torch.inference_mode():
        parts = [m(x) for m in _shards(mlp, shard_mlp)]
        torch.testing.assert_close(parts[0] + parts[1], mlp(x), rtol=1e-12, atol=1e-12)
    moe = _random(MoE(tiny_config()))
    gu = moe.experts.gate_up_proj.data  # [E, 2I, H], I = 32
    shards = _shards(moe, shard_moe)
    one = shards[1].experts
    assert one.gate_up_proj.shape == (8, 32, 64) and one.down_proj.shape == (8, 64, 16)
    assert torch.equal(one.gate_up_proj[:, :16], gu[:, 16:32]) and torch.equal(one.gate_up_proj[:, 16:], gu[:, 48:64])
    with torch.inference_mode():
        routing = moe.gate(x)
        for s in shards:  # the router is replicated: the same choice and weights, bitwise
            r = s.gate(x)
            assert torch.equal(r.experts, routing.experts) and torch.equal(r.weights, routing.weights)
        for path, tol in (("_dense", 1e-7), ("_grouped", 1e-12)):  # decode / prefill combines (dense: in fp32)
            full = getattr(moe.experts, path)(x, routing) + moe.shared_experts(x)
            parts = [getattr(s.experts, path)(x, routing) + s.shared_experts(x) for s in shards]
            assert full.abs().max() > 1e3 * tol
            torch.testing.assert_close(parts[0] + parts[1], full, rtol=0, atol=tol)
        torch.testing.assert_close(shards[0](x) + shards[1](x), moe(x), rtol=0, atol=1e-7)


def _pass(lengths: list[int], dtype=torch.float64):
    """A prefill pass of requests of `lengths` tokens: (batch, rope tables of the tiny model)."""
    lm = build_tiny(dtype=dtype).model
    batch = ForwardBatch.build([([7] * n, 0) for n in lengths])
    return batch, RopeTables.build(*lm.model.rotary_emb(batch.positions, dtype))


def test_sharded_attention_sums_to_the_full_layer():
    lm = build_tiny(dtype=torch.float64).model
    attn, cfg = lm.model.layers[0].self_attn, lm.config  # a full-indexer layer
    batch, rope = _pass([20, 27])
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want, want_sel = attn(x, rope, batch, DenseKV(cfg, dtype=torch.float64).begin(batch, [0, 1]), None)
    shards = _shards(attn, shard_attention)
    assert shards[1].q_b_proj.out_features == 2 * cfg.qk_head_dim and shards[1].cfg.num_heads == 2

    def run(rank, reduce):
        set_reduce(shards[rank], reduce)
        return shards[rank](x, rope, batch, DenseKV(cfg, dtype=torch.float64).begin(batch, [0, 1]), None)

    (out0, sel0), (out1, sel1) = in_threads(2, run)
    assert torch.equal(out0, out1) and torch.equal(sel0, want_sel) and torch.equal(sel1, want_sel)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(out0, want, rtol=1e-5, atol=1e-5)  # the reference sparse MLA runs in fp32


class _NoTable(DenseKV):
    """DenseKV without a batched index table: the indexer's per-request reference path."""

    def index_table(self, layer):
        return None


@pytest.mark.parametrize("kv_type", [DenseKV, _NoTable])
def test_sharded_indexer_sums_its_scores_before_the_top_k(kv_type):
    lm = build_tiny(dtype=torch.float64).model
    ix, cfg = lm.model.layers[0].self_attn.indexer, lm.config
    batch, rope = _pass([20, 33, 5])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=torch.float64, generator=g)
    q_lat = torch.randn(batch.num_tokens, cfg.q_lora_rank, dtype=torch.float64, generator=g)

    def kv_of(proj):
        kv = kv_type(cfg, dtype=torch.float64).begin(batch, [0, 1, 2])
        kv.store(0, torch.zeros(batch.num_tokens, cfg.latent_dim, dtype=torch.float64), proj.k)
        return kv

    with torch.inference_mode():
        full = ix.project(x, q_lat, rope)
        want = ix.select(full, batch, kv_of(full), 0, cfg.index_topk)
        keys = lambda r: kv_of(full).index_keys(0, r)  # noqa: E731
        full_scores = reference_scores(full, batch.positions, batch.query_start, keys)
    shards = _shards(ix, shard_indexer)
    assert shards[0].n_heads == 4 and shards[0].weight_scale == cfg.index_n_heads**-0.5

    def run(rank, reduce):
        set_reduce(shards[rank], reduce)
        proj = shards[rank].project(x, q_lat, rope)
        own = topk_of_scores(reference_scores(proj, batch.positions, batch.query_start, keys), cfg.index_topk)
        return proj, shards[rank].select(proj, batch, kv_of(proj), 0, cfg.index_topk), own

    (p0, sel0, own0), (p1, sel1, _) = in_threads(2, run)
    assert torch.equal(p0.k, full.k)  # the index key is replicated
    summed = reference_scores(p0, batch.positions, batch.query_start, keys) + reference_scores(
        p1, batch.positions, batch.query_start, keys)
    torch.testing.assert_close(summed, full_scores, rtol=1e-5, atol=1e-5)  # fp32 scores
    assert torch.equal(sel0, want) and torch.equal(sel1, want)
    assert not torch.equal(own0, want)  # one rank's heads alone select other rows: the sum matters


def test_sharded_model_logits_equal_the_full_model_through_prefill_and_decode():
    lm = build_tiny(dtype=torch.float64).model
    shards = [build_tiny(dtype=torch.float64).model for _ in range(2)]
    for r, m in enumerate(shards):
        shard_tensor_parallel(m, r, 2)
    prompts = [[5 + (7 * j) % 90 for j in range(24)], [9 + (5 * j) % 80 for j in range(31)]]

    def greedy(model, rank=0):
        kv = DenseKV(model.config, dtype=torch.float64)
        chunks, logits = [(p, 0) for p in prompts], []
        for _ in range(4):
            batch = ForwardBatch.build(chunks)
            out = model.logits(model(batch, kv.begin(batch, [0, 1])).hidden[batch.last_token_index()])
            logits.append(out)
            chunks = [([int(t)], n) for t, n in zip(out.argmax(-1), batch.lens)]
        return logits

    want = greedy(lm)

    def run(rank, reduce):
        set_reduce(shards[rank], reduce)
        return greedy(shards[rank], rank)

    got0, got1 = in_threads(2, run)
    for a, b, w in zip(got0, got1, want):
        assert torch.equal(a, b)  # every rank holds the same bits
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-4)  # attention, scores and dense MoE combine run in fp32
        assert torch.equal(a.argmax(-1), w.argmax(-1)) and w.abs().max() > 1.0


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return one_process_tokens(PROMPTS, GREEDY)


@pytest.mark.parametrize("preset", world_presets())
def test_tp2_tokens_equal_one_process_with_the_row_checker_and_one_routing_on_every_rank(preset, references):
    engine = build(EngineConfig(model="tiny", preset=preset, **TP), on_engine="dist_hooks:same_routing")
    try:
        assert engine.engine.model.model.layers[0].self_attn.cfg.num_heads == 2  # rank 0 holds its half
        assert generate_on(engine, PROMPTS, GREEDY) == references[preset]
        per_rank, st = engine.rank_stats(), engine.stats()
        assert [s.admitted for s in per_rank] == [len(PROMPTS)] * 2  # every request on every rank
        assert st.admitted == len(PROMPTS) and st.counters["tp_size"] == 2  # counted once
        assert per_rank[0].generated_tokens == per_rank[1].generated_tokens == st.generated_tokens
        assert per_rank[0].kv_pages_total == per_rank[1].kv_pages_total == st.kv_pages_total
        if preset == "hisparse":  # each rank's own (replicated) hierarchy fetched the same rows from host
            assert per_rank[0].counters["host_selected_rows"] == per_rank[1].counters["host_selected_rows"] > 0
    finally:
        engine.close()
    assert not torch.distributed.is_initialized() and all(not p.is_alive() for p in engine.procs)


def test_tp2_prefix_abort_and_unseeded_sampling():
    llm = LLM("tiny", preset="adaptive", **TP)
    eng = llm.engine
    try:
        prefix = [7 + (5 * j) % 80 for j in range(40)]
        eng.prepare_prefix(prefix)
        prompts = [prefix + [11 + i] for i in range(2)]
        ref = [o.token_ids for o in LLM("tiny", preset="adaptive", dtype="float64", device="cpu").generate(prompts, GREEDY)]
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == ref and all(o.metrics.imported_len == 40 for o in outs)
        hot = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)  # no seed: rank 0 draws one for all
        assert len(llm.generate(PROMPTS[:2], hot)[1].token_ids) == 8
        rids = [eng.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in PROMPTS[:2]]
        for _ in range(3):
            eng.step()
        assert eng.abort(rids[0]) and eng.abort(rids[1])
        eng.step()
        assert not eng.has_unfinished()
        assert [s.kv_pages_used for s in eng.rank_stats()] == [0, 0]  # both ranks freed the aborted requests
    finally:
        llm.close()


def test_a_rank_that_drops_a_request_is_rank_lost_at_the_first_step():
    engine = build(EngineConfig(model="tiny", preset="hisparse", **TP), on_engine="dist_hooks:drop_request_on_rank1")
    try:
        t0 = time.monotonic()
        with pytest.raises(RankLost, match="rank 1 is lost during the tensor-parallel batch check"):
            generate_on(engine, PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 10.0  # found at the check, not at the deadline
    finally:
        engine.close()
    assert not torch.distributed.is_initialized()
