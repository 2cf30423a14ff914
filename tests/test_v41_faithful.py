"""`v41-faithful` (models/v4_faithful.py): DeepSeek-V4-Flash's geometry with the paper's V4.1 shared
sources, the memory arithmetic of its docstring, FP8 weights where it says, no confident head, and
a small build through the same code exact across presets on the CPU."""

from __future__ import annotations

import pytest
import torch

from dhisparse.core.params import SamplingParams
from dhisparse.core.v4_config import CSA, HCA, SLIDING
from dhisparse.core.v4_sources import FULL, REINDEX, REUSE
from dhisparse.layers.fp8_linear import Fp8Linear
from dhisparse.layers.v4_moe import Fp8V4Experts
from dhisparse.models.dsv4 import DeepseekV4ForCausalLM
from dhisparse.models.faithful import weight_bytes
from dhisparse.models.registry import builtin_names
from dhisparse.models.tokenizer import ByteTokenizer
from dhisparse.models.v4_faithful import (ROUTED_EXPERTS, build_v41_faithful, quantize_v4_module, v41_faithful_config,
                                          v41_flash_plan)

# a small geometry through the same builder (the 512-wide K = V head and 128 index keys of V4 kept)
SMALL = dict(hidden_size=256, num_attention_heads=4, q_lora_rank=128, o_groups=2, o_lora_rank=64, index_n_heads=8,
             index_topk=8, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=512,
             sliding_window=8, compress_rates={CSA: 4, HCA: 16})
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def test_geometry_is_v4_flash_with_four_shared_sources():
    cfg = v41_faithful_config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.rope_head_dim) == \
        (129280, 4096, 43, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window, cfg.csa_rate, cfg.hca_rate) == \
        (1024, 8, 1024, 128, 4, 128)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 512)
    assert (cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.scoring_func,
            cfg.routed_scaling_factor, cfg.swiglu_limit, cfg.hc_mult, cfg.hc_sinkhorn_iters) == \
        (6, 2048, 1, "sqrtsoftplus", 1.5, 10.0, 4, 20)
    assert cfg.n_routed_experts == ROUTED_EXPERTS and sum(cfg.mlp_hash) == 3
    assert (cfg.rope_compress.rope_type, cfg.rope_compress.factor, cfg.rope_compress.theta) == ("yarn", 16.0, 160000.0)
    types = cfg.layer_types
    assert types[:2] == (SLIDING, SLIDING) and types.count(CSA) == 21 and types.count(HCA) == 20
    plan = v41_flash_plan()
    src, sel = plan["kv_source_layer_ids"], plan["selection_types"]
    csa = [i for i, t in enumerate(types) if t == CSA]
    sources = sorted({src[i] for i in csa})
    assert len(sources) == 4 and [sum(src[i] == s for i in csa) for s in sources] == [5, 5, 5, 6]
    selecting = [i for i in csa if sel[i] in (FULL, REINDEX)]
    assert len(selecting) == 8  # the paper: 2.6x fewer selecting layers than GLM-5's 21
    assert all(sel[i] == REUSE for i in csa if i not in selecting)
    assert all(src[i] == i and sel[i] == FULL for i, t in enumerate(types) if t != CSA)
    with pytest.raises(ValueError, match="groups"):
        v41_flash_plan(groups=22)


def test_memory_fits_one_h200_beside_the_pools():
    """The built model's bytes (meta device, through the builder's own quantizer): ~62 GB, leaving
    over 75 GiB of an H200 for pools, activations and a drafter."""
    from dhisparse.models.v4_loader import _FP32

    cfg = v41_faithful_config()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg).to(torch.bfloat16)
        for name, p in model.named_parameters():
            if _FP32.search(name):
                p.data = p.data.float()
        for layer in model.model.layers:
            quantize_v4_module(layer)
    b = weight_bytes(model)
    total = b["fp8"] + b["other"]
    assert 55e9 < total < 66e9, total
    assert 139 * 2**30 - total > 75 * 2**30
    assert b["fp8"] > 0.85 * total  # the routed experts dominate, in FP8


def test_small_build_quantizes_what_the_docstring_says():
    lm = build_v41_faithful(num_layers=8, overrides=SMALL, dtype=torch.float32)
    layers = lm.model.model.layers
    for layer in layers:
        a = layer.self_attn
        assert all(isinstance(getattr(a, n), Fp8Linear) for n in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"))
        assert a.o_a_proj.weight.dtype == torch.float32  # grouped o_a stays in the model dtype
        assert isinstance(layer.mlp.experts, Fp8V4Experts) and layer.mlp.experts.limit == 10.0
        sh = layer.mlp.shared_experts
        assert all(isinstance(getattr(sh, n), Fp8Linear) and getattr(sh, n).expert for n in ("gate_proj", "up_proj",
                                                                                           "down_proj"))
        assert not a.o_b_proj.expert
        assert layer.mlp.gate.weight.dtype == torch.float32
    comp = layers[2].self_attn.compressor  # the source's Full layer: its compressor and indexer in FP8 too
    assert all(isinstance(m, Fp8Linear) for m in (comp.kv_proj, comp.gate_proj, comp.indexer.q_b_proj,
                                                   layers[6].self_attn.reindexer.q_b_proj))
    assert isinstance(comp.indexer.scorer.weights_proj, torch.nn.Linear)
    assert lm.config.selection_types[2:7] == (FULL, FULL, REUSE, FULL, REINDEX)
    head = lm.model.lm_head.weight
    assert head[3:].abs().sum(1).min() > 0  # every id scored (head_vocab "full", the default)
    byte = build_v41_faithful(num_layers=8, overrides=SMALL, dtype=torch.float32, head_vocab="byte")
    assert byte.model.lm_head.weight[259:].abs().sum() == 0 and torch.equal(byte.model.lm_head.weight[:259], head[:259])
    sb, sf = byte.model.state_dict(), lm.model.state_dict()
    assert all(torch.equal(sb[k], sf[k]) for k in sb if k != "lm_head.weight")
    with pytest.raises(ValueError, match="head_vocab"):
        build_v41_faithful(num_layers=1, overrides=SMALL, head_vocab="bytes")
    again = build_v41_faithful(num_layers=8, overrides=SMALL, dtype=torch.float32)
    for (n, t), (_, u) in zip(lm.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(t.float(), u.float()), n
    other = build_v41_faithful(seed=1, num_layers=8, overrides=SMALL, dtype=torch.float32)
    assert not torch.equal(other.model.lm_head.weight, head)


def _loaded(**kw):
    import dataclasses

    return dataclasses.replace(build_v41_faithful(num_layers=8, overrides=SMALL, dtype=torch.float32, **kw),
                               tokenizer=ByteTokenizer())


def test_presets_give_resident_tokens_and_depend_on_attention(monkeypatch):
    """Through the engine on the CPU: hisparse and adaptive (rows through the hot cache and the
    host) give resident's greedy tokens; cutting attention's output projection changes them (no
    confident head)."""
    from v4_engine_util import SourceCheck, engine, generate

    lm = _loaded()
    prompts = [[3 + (5 * i + 7 * j) % 250 for i in range(n)] for j, n in enumerate((70, 97, 123))]
    want = generate(engine(lm, preset="resident", hot_cache_rows=8), prompts, GREEDY)
    ck = SourceCheck().install(monkeypatch)  # every located / reused row checked against a shadow copy
    for preset in ("hisparse", "adaptive"):
        assert generate(engine(lm, preset=preset, hot_cache_rows=8), prompts, GREEDY) == want, preset
    assert ck.located > 0 and sum(ck.host_rows.values()) > 0 and ck.reused > 0  # host fetches and Reuse layers ran
    for layer in lm.model.model.layers:
        layer.self_attn.o_b_proj.weight.zero_()
    assert generate(engine(lm, preset="resident", hot_cache_rows=8), prompts, GREEDY) != want


def test_head_reads_no_locality_offset_and_the_output_varies(monkeypatch):
    """`faithful.offset_free_head` in the V4 build: at V4-Flash's 43 layers (small geometry, bf16) the
    old build (the head keeping the offset's component, no `offset_blind`) repeats one token from the
    second on, for two prompts alike; the offset-free build holds three or more ids from the second
    on in both (a loose bound: bf16 CPU matmuls differ across platforms, and random weights fall into
    cycles of a few tokens)."""
    import dataclasses

    from v4_engine_util import engine, generate

    from dhisparse.bench.workload import prefix_ids, suffix_text
    from dhisparse.models import v4_faithful

    tok = ByteTokenizer()
    prompts = [prefix_ids(tok, 100, SMALL["vocab_size"]) + tok.encode(suffix_text(i)) for i in range(2)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def outputs(head_vocab="full"):
        lm = dataclasses.replace(build_v41_faithful(num_layers=43, overrides=SMALL, dtype=torch.bfloat16,
                                                    head_vocab=head_vocab), tokenizer=tok)
        return generate(engine(lm, preset="resident", hot_cache_rows=8), prompts, params)

    assert all(len(set(o[1:])) >= 3 for o in outputs())
    monkeypatch.setattr(v4_faithful, "offset_free_head", lambda model, shared: None)  # the build before session 36
    monkeypatch.setattr(v4_faithful, "offset_blind", lambda layer, shared, names: None)
    assert all(len(set(o[1:])) == 1 for o in outputs("byte"))  # and the byte head of then


def test_layers_add_no_part_common_to_every_position(monkeypatch):
    """`faithful.offset_blind` with V4's names (`V4_OFFSET_BLIND`): the final normed states of a 300-token
    prefill, the offset's direction taken out, share little energy in one common vector (16 small
    layers, fp32: 0.43 without it, 0.13 with it; the rest is attention's averaging over a shared
    history). glm5-faithful's full build answered every prompt with one token at a share near the
    former (session 37)."""
    import dataclasses

    from v4_engine_util import engine, generate

    from bench.faithful_diversity import common_share
    from dhisparse.bench.workload import prefix_ids, suffix_text
    from dhisparse.models import v4_faithful
    from dhisparse.models.v4_faithful import v4_offset_direction

    tok = ByteTokenizer()
    prompt = prefix_ids(tok, 300, SMALL["vocab_size"]) + tok.encode(suffix_text(0))

    def share() -> float:
        lm = dataclasses.replace(build_v41_faithful(num_layers=16, overrides=SMALL, dtype=torch.float32), tokenizer=tok)
        got = []
        lm.model.model.norm.register_forward_hook(lambda m, i, o: got.append(o.detach().float().clone()))
        generate(engine(lm, preset="resident", hot_cache_rows=8), [prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        return common_share(torch.cat(got)[:len(prompt)], v4_offset_direction(SMALL["hidden_size"], 0, "cpu"))

    assert share() < 0.2
    monkeypatch.setattr(v4_faithful, "offset_blind", lambda layer, shared, names: None)
    assert share() > 0.3


def test_registered():
    assert "v41-faithful" in builtin_names()


def test_selection_locality_bumps_only_the_index_queries_and_not_their_rope_dims():
    """`stable_v4_index_query` on the unquantized model: a Full CSA layer's indexer query and a
    Reindex layer's move by a rank-1 term along the shared embedding direction, zero on the
    trailing RoPE'd dims; every other weight is unchanged. (The measured effect on hisparse's
    host-fetched share: bench/results/locality_v41_faithful_small_cpu_s30.json.)"""
    from dhisparse.models.v4_faithful import stable_v4_index_query
    from dhisparse.models.v4_scaled import build_v4_random

    cfg = v41_faithful_config(8, SMALL)
    model = build_v4_random(cfg, seed=0)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    shared, gen = torch.randn(cfg.hidden_size), torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        stable_v4_index_query(layer, shared, 8.0, gen)
    after = model.state_dict()
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    assert changed == ["model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
                       "model.layers.6.self_attn.reindexer.q_b_proj.weight"]  # the source's Full and Reindex layers
    for n in changed:
        delta = after[n] - before[n]
        assert torch.linalg.matrix_rank(delta) == 1
        heads = delta.reshape(cfg.index_n_heads, cfg.index_head_dim, -1)
        assert heads[:, -cfg.rope_head_dim:].abs().max() == 0 and heads.abs().max() > 0
