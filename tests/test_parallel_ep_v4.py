"""Expert parallelism for DeepSeek-V4 (gloo, CPU processes): `EPMoE` over a `V4MoE` (scored and
hash-routed layers) equals the full layer in a world of one and is batch invariant; `idle_pass`
calls every V4 EPMoE layer with zero rows and zero token ids; DP2+EP2 greedy tokens of a tiny V4
checkpoint equal the single-process engine's under resident / hisparse / adaptive / adaptive+spec,
with V4's row checker (v4_engine_util.SourceCheck: every located CSA row is the selected row of
the right request) on every rank; an idle rank joins every exchange.

Breakages tried by hand, and the tests that failed for each:
- hash-routed layers given positions instead of token ids: in `EPMoE.route` (the owner's router):
  test_v4_epmoe_equals_v4moe..., test_hash_routing_reads_the_token_ids and every
  test_dp2_ep2_v4_tokens...; in `V4DecoderLayer` (`batch.positions` to the MoE):
  test_the_v4_decoder_hands_its_ep_layers_the_token_ids (and test_v4_engine.py's transformers
  parity; one process is wrong the same way, so DP2+EP2 parity alone cannot see it); on rank 1
  only, hook `v4_positions_as_ids_on_rank1`: test_broken_v4_ep_on_rank1_changes_the_tokens;
- a rank's expert block swapped (`expert_block` giving rank r block W-1-r):
  test_v4_sharding_keeps_the_block_and_names_the_cuts and every test_dp2_ep2_v4_tokens...; rank 1's
  block flipped, hook `v4_swap_experts_on_rank1`: test_broken_v4_ep_on_rank1_changes_the_tokens;
- an idle rank skipping its V4 idle pass (`idle_pass` leaving out V4 layers):
  test_idle_pass_calls_every_v4_layer_with_zero_rows_and_ids and test_dp2_ep2_v4_tokens...[resident]
  (RankLost after --dist-timeout); hook `no_idle_pass_on_rank1`:
  test_a_v4_rank_that_skips_its_idle_pass_is_rank_lost_not_a_hang (RankLost, not a hang).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dhisparse import LLM
from dhisparse.core.parallel import ParallelConfig, RankLost, init_rank, leave
from dhisparse.core.params import SamplingParams
from dhisparse.core.v4_config import V4Config
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.launch import build, free_addr
from dhisparse.kv.v4.hier_pass import V4HierPass
from dhisparse.kv.v4.state import V4RequestState
from dhisparse.layers.ep_moe import EP_TILE, EPMoE, expert_cuts, idle_pass, shard_experts
from dhisparse.layers.moe import Routing
from dhisparse.models.v4_scaled import build_v4_random
from dist_hooks import ByPreset, generate_on, world_presets
from v4_fixtures import V4_TINY, new_state, prompt_ids, save_state, step

CFG = dict(V4_TINY, mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"])  # two hash-routed layers
PROMPTS = [prompt_ids(9 + 7 * i, seed=i) for i in range(5)]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SMALL = dict(dtype="float64", device="cpu", page_size=4, max_num_batched_tokens=16, kv_pool_bytes=8 << 20,
             host_pool_bytes=16 << 20)
EP = dict(SMALL, tp_size=2, dp_size=2, ep_size=2, enable_dp_attention=True, dist_timeout_s=60.0)  # s22: 20 s was short for a CUDA spawn among 14 test workers


def _model():
    return build_v4_random(V4Config.from_hf(CFG), seed=3, dtype=torch.float64)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    state = build_v4_random(V4Config.from_hf(CFG), seed=3).state_dict()  # fp32 on disk, loaded as fp64
    return save_state({k: v.clone() for k, v in state.items()}, tmp_path_factory.mktemp("v4ep") / "ckpt", CFG)


@pytest.fixture()
def world_of_one():
    init_rank(ParallelConfig(dp_size=1, timeout_s=20), 0, free_addr())
    yield
    leave()


@pytest.fixture()
def keep_v4_passes(monkeypatch):
    """Rank 0 runs in this process: the row checker's class patches are undone after the test."""
    for cls, name in [(V4HierPass, "append_rows"), (V4HierPass, "locate"), (V4HierPass, "reuse"),
                      (V4RequestState, "rollback")]:
        monkeypatch.setattr(cls, name, getattr(cls, name))


def _rows(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, CFG["hidden_size"], generator=g, dtype=torch.float64), torch.randint(3, 128, (n,), generator=g)


def test_v4_epmoe_equals_v4moe_and_is_batch_invariant(world_of_one):
    model = _model()
    x, ids = _rows(3 * EP_TILE + 5)
    with torch.inference_mode():
        for i, layer in enumerate(model.model.layers):
            moe = layer.mlp
            ref = moe.experts._grouped(x, moe.gate(x, ids)) + moe.shared_experts(x)
            torch.testing.assert_close(moe(x, ids), ref, rtol=1e-5, atol=1e-6)  # its dense path combines in fp32
            ep = EPMoE(copy.deepcopy(moe), 0, 1)
            torch.testing.assert_close(ep(x, ids), ref, rtol=1e-12, atol=1e-12)
            assert ep.takes_ids and ep.gate.hashed == (i in (0, 2))
            r = ep.route(x, ids)
            routed = ep.routed(x, r)
            for t in (0, 7, x.shape[0] - 1):  # a token alone and in the batch: the same bits
                alone = ep.routed(x[t : t + 1], Routing(r.experts[t : t + 1], r.weights[t : t + 1]))
                assert torch.equal(alone[0], routed[t])
            assert ep(x[:0], ids[:0]).shape == (0, CFG["hidden_size"])


def test_hash_routing_reads_the_token_ids(world_of_one):
    model = _model()
    x, ids = _rows(20)
    with torch.inference_mode():
        hashed, scored = (EPMoE(copy.deepcopy(model.model.layers[i].mlp), 0, 1) for i in (0, 1))
        positions = torch.arange(20)
        assert not torch.allclose(hashed(x, positions), hashed(x, ids))  # positions are not token ids
        assert torch.equal(scored(x, positions), scored(x, ids))  # a scored router ignores them
        with pytest.raises(ValueError, match="input_ids"):
            hashed(x)


def test_v4_sharding_keeps_the_block_and_names_the_cuts():
    model = _model()
    full = [layer.mlp.experts.gate_up_proj.data.clone() for layer in model.model.layers]
    cuts = expert_cuts(model, 1, 2)
    assert len(cuts) == 8 and cuts["model.layers.0.mlp.experts.down_proj"].spans == ((2, 4),)
    assert shard_experts(model, 1, 2) == 4
    for layer, f in zip(model.model.layers, full):
        assert isinstance(layer.mlp, EPMoE) and layer.mlp.n_local == 2
        assert torch.equal(layer.mlp.experts.gate_up_proj, f[2:4])


def test_idle_pass_calls_every_v4_layer_with_zero_rows_and_ids(world_of_one):
    model = _model()
    shard_experts(model, 0, 1)
    seen = []
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_hook(lambda m, args, out, i=i: seen.append((i, args[0].shape, args[1].shape)))
    idle_pass(model, torch.float64, torch.device("cpu"))
    assert seen == [(i, (0, CFG["hidden_size"]), (0,)) for i in range(4)]


def test_the_v4_decoder_hands_its_ep_layers_the_token_ids(world_of_one):
    model, ids = _model(), prompt_ids(11, seed=4)
    shard_experts(model, 0, 1)
    seen = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, args, out: seen.append(args[1].tolist()))
    cache, state = new_state(model)
    step(model, cache, state, ids)
    assert seen == [ids] * 4


@pytest.fixture(scope="module")
def references(folder) -> dict[str, list[list[int]]]:
    return ByPreset(lambda p: [o.token_ids for o in LLM(str(folder), preset=p, **SMALL).generate(PROMPTS, GREEDY)])


@pytest.mark.parametrize("preset", world_presets())
def test_dp2_ep2_v4_tokens_equal_one_process_with_the_row_checker(preset, folder, references, keep_v4_passes):
    engine = build(EngineConfig(model=str(folder), preset=preset, **EP), on_engine="dist_hooks:v4_source_check")
    try:
        assert generate_on(engine, PROMPTS, GREEDY) == references[preset]
        assert all(s.admitted >= 2 for s in engine.rank_stats())
        assert generate_on(engine, PROMPTS[:1], GREEDY) == references[preset][:1]  # rank 1 idles: joins every exchange
        assert preset == "resident" or engine.engine.source_check.located > 0  # rank 0's rows were checked
    finally:
        engine.close()
    assert not dist.is_initialized()


@pytest.mark.parametrize("hook", ["v4_swap_experts_on_rank1", "v4_positions_as_ids_on_rank1"])
def test_broken_v4_ep_on_rank1_changes_the_tokens(hook, folder, references, keep_v4_passes):
    engine = build(EngineConfig(model=str(folder), preset="adaptive", **EP), on_engine=f"dist_hooks:{hook}")
    try:
        assert generate_on(engine, PROMPTS, GREEDY) != references["adaptive"]
    finally:
        engine.close()


def test_a_v4_rank_that_skips_its_idle_pass_is_rank_lost_not_a_hang(folder):
    # the timeout is how long the hang takes to detect, and it also bounds start-up: 8 s timed out among
    # 14 CUDA test workers, so 20 s where CUDA is present; a CPU-only machine starts the world in ~2 s
    timeout = 20.0 if torch.cuda.is_available() else 12.0
    engine = build(EngineConfig(model=str(folder), preset="resident", **(EP | dict(dist_timeout_s=timeout))),
                   on_engine="dist_hooks:no_idle_pass_on_rank1")
    try:
        with pytest.raises(RankLost):
            generate_on(engine, PROMPTS[:1], GREEDY)  # one request: rank 0 runs a pass, rank 1 (broken) skips it
    finally:
        engine.close()
