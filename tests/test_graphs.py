"""Piecewise FFN graphs: bucketing, padding and output ownership (eager runner on CPU; the CUDA
runner records the same function)."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.models.graphs import EagerRunner, PiecewiseGraphs, graphs_for, graph_buckets


def tiny_llm() -> LLM:
    """CPU engine (also on a GPU machine): these tests drive bucketing with the eager runner."""
    return LLM("tiny", page_size=8, device="cpu")


def test_rope_tables_are_copied_once_per_pass():
    g = PiecewiseGraphs(EagerRunner(), buckets=(4,), pieces=("pre", "ffn"))
    seen = []
    fn = lambda h, C, S: seen.append((h.clone(), C.clone())) or h  # noqa: E731
    h1, C = torch.randn(3, 5), torch.randn(3, 2)
    g.pre(0, fn, h1, C, C)
    g.pre(1, fn, torch.randn(3, 5), C, C)  # same tables object: not copied again
    assert torch.equal(seen[1][1][:3], C)
    C2 = torch.randn(3, 2)
    g.pre(1, fn, h1, C2, C2)  # a new pass's tables are copied
    assert torch.equal(seen[2][1][:3], C2) and torch.equal(seen[2][0][:3], h1)


def test_replays_equal_eager_ffn_and_own_their_outputs():
    llm = tiny_llm()
    layer = llm.engine.model.model.layers[0]
    g = PiecewiseGraphs(EagerRunner(), buckets=(1, 2, 4, 8))
    torch.manual_seed(0)
    for T in (1, 3, 5, 8, 13):
        h = torch.randn(T, layer.post_attention_layernorm.weight.shape[0])
        torch.testing.assert_close(g(0, layer.ffn, h), layer.ffn(h), rtol=1e-5, atol=1e-5)
    assert g.eager == 1 and g.replayed == 4  # T = 13 exceeds the largest bucket
    assert set(g.replays) == {("ffn", 0, 1, ()), ("ffn", 0, 4, ()), ("ffn", 0, 8, ())}
    a = g(0, layer.ffn, torch.ones(3, layer.post_attention_layernorm.weight.shape[0]))
    keep = a.clone()
    g(0, layer.ffn, torch.zeros(3, layer.post_attention_layernorm.weight.shape[0]))  # same graph replays
    assert torch.equal(a, keep)  # an earlier result is not overwritten by the next replay


@pytest.mark.parametrize("pieces", [("ffn",), ("pre", "ffn"), ("pre", "attn")])
def test_engine_with_piece_replays_generates_the_same_tokens(pieces):
    prompts = [[5 + (3 * i + j) % 90 for j in range(9 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in tiny_llm().generate(prompts, params)]
    llm = tiny_llm()
    graphs = llm.engine.model.graphs = PiecewiseGraphs(EagerRunner(), buckets=(1, 2, 4, 8), pieces=pieces)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    finally:
        llm.engine.model.graphs = None
    assert graphs.replayed > 0 and graphs.eager > 0  # decode steps replay, long prefill chunks run eagerly
    assert {k[0] for k in graphs.replays} == set(pieces)


@pytest.mark.parametrize("preset,spec", [("hisparse", {}), ("adaptive", {}),
                                         ("hisparse", {"speculative_algorithm": "ngram"})])
def test_attention_piece_over_the_hierarchy_generates_the_same_tokens(preset, spec):
    """Sparse attention inside the replayed piece over hierarchy row spaces (hot-cache misses; with
    verification the staging rows as a second space): tokens of eager resident serving, and every
    'attn' replay key names this engine's own row spaces."""
    from dhisparse.models.graphs import spaces_key

    prompts = [[5 + (3 * i + j) % 90 for j in range(9 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in tiny_llm().generate(prompts, params)]
    llm = LLM("tiny", preset=preset, page_size=4, device="cpu", hot_cache_rows=16, kv_pool_bytes=1 << 20,
              max_running_requests=8, **spec)  # 8 slots: paper staging (chi 3) fits the 1-MiB pool
    e = llm.engine
    graphs = e.model.graphs = PiecewiseGraphs(EagerRunner(), buckets=(1, 2, 4, 8, 16, 32), pieces=("pre", "attn"))
    try:
        e.model.capture_graphs(e.config.max_running_requests, e._row_spaces)
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    finally:
        e.model.graphs = None
    own = {spaces_key(r) for i in range(len(e.model.model.layers)) for r in e._row_spaces(i)}
    assert {k[3] for k in graphs.replays if k[0] == "attn"} <= own and graphs.replayed > 0
    assert len(own) == len(e.model.model.layers) * (2 if spec else 1)


def test_attention_piece_pads_locations_and_is_keyed_by_row_spaces():
    g = PiecewiseGraphs(EagerRunner(), buckets=(4,), pieces=("pre", "attn"))
    seen = []
    fn = lambda rows, h, q, p, loc: seen.append(loc.clone()) or h + rows.sum()  # noqa: E731
    a, b = torch.ones(2, 3), torch.zeros(5, 3)
    h, q = torch.randn(3, 2), torch.randn(3, 1, 1)
    g.attn(0, a, lambda *x: fn(a, *x), h, q, q, torch.arange(6).view(3, 2))
    g.attn(0, a, lambda *x: fn(a, *x), h[:2], q[:2], q[:2], torch.arange(4).view(2, 2))
    assert seen[1][2:].eq(-1).all() and torch.equal(seen[1][:2], torch.arange(4).view(2, 2))
    g.attn(0, b, lambda *x: fn(b, *x), h, q, q, torch.zeros(3, 2, dtype=torch.int64))
    assert len(g.replays) == 2  # one graph per row-space identity
    assert g.keep_spaces({next(k[3] for k in g.replays if k[3][0][1] == (5, 3))}) == 1 and len(g.replays) == 1


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="increasing"):
        PiecewiseGraphs(EagerRunner(), buckets=(4, 2))
    with pytest.raises(ValueError, match="pieces"):
        PiecewiseGraphs(EagerRunner(), pieces=("attention",))
    with pytest.raises(ValueError, match="routed experts"):
        graph_buckets(256)
    assert max(graph_buckets(16)) * 16 <= 1 << 16
    with pytest.raises(ValueError, match="--cuda-graphs none"):
        graphs_for(torch.device("cpu"), "ffn", 16)
    assert graphs_for(torch.device("cpu"), "none", 16) is None
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM("tiny", cuda_graphs="all")
    with pytest.raises(ValueError, match="--cuda-graphs none"):
        graphs_for(torch.device("cpu"), "layer", 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
@pytest.mark.parametrize("mode", ["ffn", "layer", "step"])
def test_cuda_graph_replays_generate_the_same_tokens(preset, mode):
    """Captured pieces (padded to their bucket) give every preset the tokens of eager execution."""
    prompts = [[5 + (3 * i + j) % 90 for j in range(9 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM("tiny", page_size=8, device="cuda").generate(prompts, params)]
    llm = LLM("tiny", preset=preset, page_size=8, device="cuda", cuda_graphs=mode, kv_pool_bytes=1 << 24,
              host_pool_bytes=1 << 24)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.engine.model.graphs.replayed > 0


def test_auto_mode_picks_step_only_where_capture_works():
    from dhisparse.models.graphs import auto_graph_mode

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto_graph_mode(cuda, True, 16) == "step"
    assert auto_graph_mode(cpu, True, 16) == "none"
    assert auto_graph_mode(cuda, False, 0) == "none"  # DeepSeek-V4 model: no pieces
    assert auto_graph_mode(cuda, True, 256) == "none"  # real GLM-5 experts: the MoE path syncs
    assert LLM("tiny", device="cpu").engine.graph_mode == "none"


def test_graphs_outlive_an_engine_and_report_counters():
    from dhisparse.models.graphs import CudaGraphRunner, graph_counters

    g = PiecewiseGraphs(EagerRunner(), buckets=(1, 2), pieces=("pre", "ffn"))
    assert graph_counters(None) == {}
    c = graph_counters(g)
    assert c["graphs_captured"] == 0 and c["graph_replays"] == 0
    if torch.cuda.is_available():
        cuda = PiecewiseGraphs(CudaGraphRunner(), (1, 2), ("pre", "attn"))
        assert graphs_for(torch.device("cuda"), "layer", 16, cuda) is cuda  # kept for the next engine
        assert graphs_for(torch.device("cuda"), "ffn", 16, cuda) is not cuda  # other pieces: new graphs


def test_graphs_captured_up_front_for_decode_batches_only():
    """capture_graphs records every piece for the buckets up to the decode batch; generation then
    captures nothing more, longer passes (prefill chunks) run eagerly, tokens unchanged."""
    prompts = [[5 + (3 * i + j) % 90 for j in range(9 + 7 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in tiny_llm().generate(prompts, params)]
    llm = tiny_llm()
    model = llm.engine.model
    g = model.graphs = PiecewiseGraphs(EagerRunner(), buckets=(1, 2, 4, 8, 16), pieces=("pre", "ffn"))
    try:
        n = model.capture_graphs(5)
        layers = len(model.model.layers)
        assert n == 4 * layers * 2 and g.limit == 8 and g.bucket(9) is None and g.bucket(5) == 8
        assert model.capture_graphs(3) == 0 and g.limit == 8  # shared by engines: the limit never drops
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
        assert len(g.replays) == n and g.replayed > 0 and g.eager > 0
    finally:
        model.graphs = None
