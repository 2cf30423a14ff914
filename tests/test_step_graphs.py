"""Whole-step graphs (engine/step_graphs.py): bucketing, padding and exactness on CPU with the eager
runner (the CUDA runner records the same static-buffer forward). The hierarchy's step graphs need
the deferred resolver: Triton, interpreted on CPU."""

from __future__ import annotations

from types import SimpleNamespace
import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.engine.step_graphs import StepGraphs, width_bucket
from dhisparse.models.graphs import EagerRunner

PROMPTS = [[5 + (3 * i + j) % 90 for j in range(20 + 9 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, ignore_eos=True)  # CI-sized lockstep / arrival tests (interpreted Triton under hisparse)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_POOL = 8 << 20  # lockstep tests compare every KV byte after every step: a small pool keeps that cheap  # Triton runs interpreted on CPU only where CUDA is absent


def llm(preset: str = "resident", **kw) -> LLM:
    kw.setdefault("page_size", 8)
    if preset != "resident":
        kw.setdefault("resolver", "triton")
        kw.setdefault("hot_cache_rows", 16)
    return LLM("tiny", preset=preset, device=DEVICE, cuda_graphs="none", **kw)


def with_steps(model: LLM) -> StepGraphs:
    model.engine.step_graphs = model.engine.make_step_graphs(EagerRunner())
    return model.engine.step_graphs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in llm().generate(PROMPTS, GREEDY)]


def test_width_buckets_are_powers_of_two_capped_at_the_model_length():
    assert [width_bucket(w, 5000) for w in (1, 64, 65, 1000, 4096, 4097, 5000)] == [64, 64, 128, 1024, 4096, 5000, 5000]
    assert width_bucket(5001, 5000) is None


def test_request_buckets_keep_tokens_on_the_token_buckets():
    g = StepGraphs(None, None, EagerRunner(), (1, 2, 4, 8, 12, 16), 100, None)
    assert [g.bucket(n, 1) for n in (1, 3, 5, 9, 16, 17)] == [1, 4, 8, 12, 16, None]
    assert [g.bucket(n, 4) for n in (1, 2, 3, 4, 5)] == [1, 2, 3, 4, None]  # 4, 8, 12, 16 tokens


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_step_graphs_generate_the_same_tokens(preset, reference):
    model = llm(preset)
    g = with_steps(model)
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert g.replayed > 0 and g.eager > 0  # decode steps replay; prefill steps run eagerly
    assert len(model.engine.arena.pool.owned_by("step-graph-scratch")) == 1
    stats = model.engine.stats().as_dict()
    assert stats["step_graph_replays"] == g.replayed
    # the scratch page is the engine's own: an idle engine reports an empty pool one page smaller
    assert stats["kv_pages_used"] == 0 and stats["kv_pages_total"] == model.engine.arena.pool.num_pages - 1


def test_verification_passes_replay_with_staging(reference):
    """Speculative verification (K = 5 tokens a request) over the hierarchy: a hot cache of index_topk
    rows forces the union of a request's K selections through the staging arena."""
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    model = LLM.__new__(LLM)
    model.engine = Engine(EngineConfig(preset="hisparse", resolver="triton", hot_cache_rows=16, page_size=8, device=DEVICE,
                                       cuda_graphs="none",
                                       speculative_algorithm="oracle", speculative_num_draft_tokens=4,
                                       speculative_oracle_tokens_per_round=3.0),
                          oracle_reference={tuple(p): r for p, r in zip(PROMPTS, reference)})
    g = with_steps(model)
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert any(k[0][1] == 4 and n for k, n in ((k, e.uses) for k, e in g.entries.items()))  # K = 4 verification graphs replayed
    assert model.engine.stats().as_dict()["resolver_overflow"] > 0


def _same_state(sa: dict, sb: dict, step: int) -> None:
    """KV rows equal up to float rounding (a graph runs a token at another row of its GEMMs than the
    eager pass: CPU BLAS may round that row differently); resolver state exactly."""
    for name in sa:
        if name == "storage":
            torch.testing.assert_close(sa[name], sb[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"KV rows, step {step}: {m}")
        else:
            assert torch.equal(sa[name], sb[name]), f"{name} differs after step {step}"


def _state(model: LLM) -> dict[str, torch.Tensor]:
    e = model.engine
    storage = e.arena.storage.clone()
    storage[e.arena.pool.owned_by("step-graph-scratch")] = 0  # padded tokens write here
    out = {"storage": storage}
    for name in ("hot_pos", "hot_stamp", "tail_loc", "tail_start"):
        if hasattr(e.store, name):
            out[name] = getattr(e.store, name).clone()
    return out


@pytest.mark.parametrize("preset", ["resident", "hisparse"])
def test_padded_requests_leave_every_real_state_as_an_eager_step_does(preset):
    """Two engines in lockstep, one eager, one replaying step graphs: 3 requests run in a bucket
    of 4 (one padded request), and after every step all KV rows (but the scratch page; up to float
    rounding), the hot caches with their LRU stamps and the tails are identical."""
    eager, graphed = llm(preset, kv_pool_bytes=SMALL_POOL), llm(preset, kv_pool_bytes=SMALL_POOL)
    eager.engine.make_step_graphs(EagerRunner())  # the same scratch page, so pages line up
    g = with_steps(graphed)
    g.token_buckets = (1, 2, 4, 8)  # three requests run in a bucket of four
    for m in (eager, graphed):
        for p in PROMPTS:
            m.engine.add_request(p, SHORT)
    steps = 0
    while eager.engine.has_unfinished():
        a, b = eager.engine.step(), graphed.engine.step()
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        _same_state(_state(eager), _state(graphed), steps)
        steps += 1
    assert not graphed.engine.has_unfinished()
    assert {k[1] for k in g.entries} == {4}  # three requests, bucket 4
    if preset != "resident":
        ca, cb = eager.engine.store.census.copy(), graphed.engine.store.census.copy()
        assert ca._tot == cb._tot and ca.calls == cb.calls  # the padded request adds no counts


class ForgetfulRunner:
    """Holds its thunk only weakly, like a CUDA graph (it keeps raw addresses, not the tensors)."""

    def capture(self, thunk):
        import weakref

        ref = weakref.ref(thunk)

        def replay():
            fn = ref()
            assert fn is not None, "the captured step (and the static batch it reads) was freed"
            return fn()

        return replay


def test_entries_keep_what_their_graph_reads_alive(reference):
    model = llm()
    model.engine.step_graphs = g = model.engine.make_step_graphs(ForgetfulRunner())
    import gc

    gc.collect()
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert g.replayed > 0


def test_ragged_verification_passes_replay_padded_tokens_and_keep_state():
    """n-gram drafts of different lengths per request: verification passes are ragged (1..4 tokens a
    request) and replay with padded tokens; lockstep with an eager engine, every KV row, hot-cache
    slot, stamp and tail stays identical, and so do the tokens."""
    kw = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4, kv_pool_bytes=SMALL_POOL)
    eager, graphed = llm("hisparse", **kw), llm("hisparse", **kw)
    eager.engine.make_step_graphs(EagerRunner())
    g = with_steps(graphed)
    prompts = [[7, 8, 9, 10] * (6 + i) + [11 + i] for i in range(2)] + [[30 + (5 * j) % 41 for j in range(27)]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)  # CI-sized: lockstep state checks after every step
    for m in (eager, graphed):
        for p in prompts:
            m.engine.add_request(p, params)
    while eager.engine.has_unfinished():
        a, b = eager.engine.step(), graphed.engine.step()
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        _same_state(_state(eager), _state(graphed), -1)
    assert g.ragged > 0


def test_a_pass_wider_than_the_model_length_runs_eagerly():
    model = llm()
    g = with_steps(model)
    g.max_width = 16  # every table is wider: no graph
    ref = [o.token_ids for o in llm().generate(PROMPTS[:1], GREEDY)]
    assert [o.token_ids for o in model.generate(PROMPTS[:1], GREEDY)] == ref
    assert g.replayed == 0 and not g.entries


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive", "adaptive+spec"])
def test_cuda_step_graphs_match_eager_decoding(preset):
    """On the GPU: `--cuda-graphs step` (CUDA graph runner) gives the tokens of `--cuda-graphs none`."""
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    prompts = [[5 + (3 * i + j) % 90 for j in range(20 + 9 * i)] for i in range(5)]
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, LLM("tiny", cuda_graphs="none").generate(prompts, GREEDY))}
    kw = dict(speculative_algorithm="oracle", speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=3.0) \
        if preset.endswith("+spec") else {}
    model = LLM.__new__(LLM)
    model.engine = Engine(EngineConfig(preset=preset, cuda_graphs="step", page_size=8, hot_cache_rows=16, **kw),
                          oracle_reference=ref)
    assert [o.token_ids for o in model.generate(prompts, GREEDY)] == [ref[tuple(p)] for p in prompts]
    stats = model.engine.stats().as_dict()
    assert stats["step_graph_replays"] > 0 and stats["step_graphs_captured"] > 0
    assert stats["step_graph_capture_failures"] == 0  # a failed capture runs eagerly: same tokens, but slow


def test_a_pass_over_cuda_graph_max_bs_requests_runs_eagerly():
    g = StepGraphs(None, None, EagerRunner(), (1, 2, 4, 8, 12, 16), 100, None, max_reqs=3)
    assert [g.bucket(n, 1) for n in (1, 3, 4, 9)] == [1, 4, None, None]  # 3 pads to 4; 4 requests: eager


def test_cuda_graph_max_bs_caps_what_the_engine_captures_and_replays(reference):
    """--cuda-graph-max-bs 2: the engine's step graphs warm buckets for 1 and 2 requests only, a
    pass of three requests runs eagerly, and the tokens are unchanged."""
    model = llm("adaptive", cuda_graph_max_bs=2, max_running_requests=8)
    assert model.engine.config.graph_max_reqs == 2
    g = with_steps(model)
    g.warm(model.engine.config.graph_max_reqs)
    keys = set(g.entries)
    assert {k[1] for k in keys} == {1, 2}
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert set(g.entries) == keys and g.eager > 0
    assert [o.token_ids for o in model.generate(PROMPTS[1:], GREEDY)] == reference[1:]
    assert g.replayed > 0 and set(g.entries) == keys


def test_cuda_graph_max_bs_is_checked_and_defaults_to_max_running_requests():
    from dhisparse.engine.config import ConfigValueError, EngineConfig
    assert EngineConfig(max_running_requests=12).graph_max_reqs == 12
    assert EngineConfig(max_running_requests=12, cuda_graph_max_bs=40).graph_max_reqs == 12
    with pytest.raises(ConfigValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


@pytest.mark.parametrize("preset", ["resident", "adaptive"])
def test_a_smaller_batch_replays_a_captured_wider_graph(preset, reference):
    """Fewer requests (down to half a captured bucket) replay that bucket's graph padded instead
    of capturing their own: the tokens are unchanged and no graph is added."""
    model = llm(preset)
    g = with_steps(model)
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    keys = set(g.entries)
    assert max(k[1] for k in keys) == 3
    assert [o.token_ids for o in model.generate(PROMPTS[1:], GREEDY)] == reference[1:]
    assert set(g.entries) == keys  # two requests ran in the graph of three
    assert [o.token_ids for o in model.generate(PROMPTS[2:], GREEDY)] == reference[2:]
    assert any(k[1] == 1 for k in g.entries)  # one request: a bucket of three is over 2x, so its own


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_warm_captures_every_bucket_before_serving(preset, reference):
    """`warm` captures each request bucket (at the full width, per variant) before serving; the
    passes then replay those graphs with the eager tokens and capture nothing new."""
    model = llm(preset)
    g = with_steps(model)
    n = g.warm(3)
    keys = set(g.entries)
    assert n == len(keys) and {k[1] for k in keys} == {1, 2, 3}
    assert {k[2] for k in keys} == {model.engine.max_model_len}
    assert len({k[0][2] for k in keys}) == (2 if preset == "adaptive" else 1)  # all-direct or not
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert set(g.entries) == keys and g.replayed > 0
    assert g.warm(3) == 0  # nothing left to capture


def test_warm_captures_every_width_the_online_policy_can_choose(reference):
    """With `--speculative-policy online` every round width 1..K_max gets its graphs before serving
    (SpecConfig.round_widths): on the H200, widths captured mid-window stalled the online run
    (10-s TTFTs at C6) and their seconds-long steps priced those widths out."""
    model = llm("adaptive", speculative_algorithm="ngram", speculative_num_draft_tokens=3, speculative_policy="online")
    g = with_steps(model)
    assert g.widths == (1, 2, 3)
    g.warm(3)
    keys = set(g.entries)
    assert {k[0][1] for k in keys} == {1, 2, 3}
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    fixed = with_steps(llm("adaptive", speculative_algorithm="ngram", speculative_num_draft_tokens=3))
    assert fixed.widths == (1, 3)


def test_a_mixed_step_splits_only_onto_a_captured_graph():
    """The split never captures: without a captured graph of that K whose bucket fits the
    decodes, a mixed step stays one (eager) pass."""
    from types import SimpleNamespace as NS

    g = StepGraphs(None, SimpleNamespace(replayable=True), EagerRunner(), (1, 2, 4, 8, 12, 16), 100, None, max_k=4)
    dec = [NS(decodes=True, tokens=[1]) for _ in range(3)]
    pre = [NS(decodes=False, tokens=[1] * 9)]
    assert g.split(dec + pre) == [dec + pre]
    family = ("HierContext", 1, ("hier", False), (), ())
    g.entries[(family, 8, 64)] = None  # bucket 8 > 2 x 3 decodes: not a fit
    assert g.split(dec + pre) == [dec + pre]
    g.entries[(family, 4, 64)] = None
    assert g.split(dec + pre) == [dec, pre]
    assert g.split([NS(decodes=True, tokens=[1] * 4)] + pre) == [[NS(decodes=True, tokens=[1] * 4)] + pre]  # K = 4: none


def test_step_buckets_pad_little():
    """A step graph pads a batch by at most 8 requests up to 128 tokens (the piecewise buckets pad
    36 to 48), and every bucket stays on the MoE's sync-free path."""
    from dhisparse.engine.step_graphs import STEP_BUCKETS
    from dhisparse.models.graphs import graph_buckets

    model = llm(max_running_requests=128)  # graphs serve up to max_running_requests (--cuda-graph-max-bs)
    g = with_steps(model)
    assert g.token_buckets == graph_buckets(8, STEP_BUCKETS)
    assert g.bucket(36, 1) == 40 and g.bucket(9, 4) == 10
    assert all(g.bucket(n, 1) - n < 8 for n in range(1, 129))


def test_a_failed_capture_leaves_its_passes_to_the_eager_path(reference, caplog):
    class Failing:
        def capture(self, thunk):
            raise RuntimeError("operation not permitted when stream is capturing")

    model = llm()
    g = model.engine.step_graphs = model.engine.make_step_graphs(Failing())
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert g.failed and not g.entries and g.replayed == 0
    assert "step graph capture failed" in caplog.text
    stats = model.engine.stats().as_dict()  # what benchmark JSONs record
    assert stats["step_graph_capture_failures"] == len(g.failed) and stats["step_graph_eager_passes"] > 0


def test_census_in_place_accumulation_equals_the_pending_path():
    """Under a step-graph capture the census adds each call into one device accumulator (the ops a
    graph replays); folded, it gives the totals of the pending-list path, calls included."""
    from dhisparse.kv.hier.census import Census

    g = torch.Generator().manual_seed(3)
    calls = [(torch.randint(0, 50, (6,), generator=g), torch.randint(0, 999, (), generator=g)) for _ in range(7)]
    calls[2][0][2:4] = 0  # a wholly direct call
    a, b = Census(), Census()
    b.in_place = True
    for counts, nbytes in calls:
        a.add_device(counts, nbytes)
        b.add_device(counts, nbytes)
    assert b.calls == 0 and not b._pending  # nothing on the host until folded
    ca, cb = a.copy(), b.copy()
    assert ca._tot == cb._tot and ca.calls == cb.calls == 7 and cb.direct_calls >= 1
    assert b.copy()._tot == cb._tot  # the accumulator was zeroed by the fold: nothing counted twice


@pytest.mark.parametrize("preset,spec", [("resident", False), ("adaptive", False), ("hisparse", True)])
def test_mixed_steps_split_into_a_replayed_decode_pass_and_an_eager_prefill_pass(preset, spec):
    """Requests arriving while others decode: the step runs its decodes (or n-gram verification
    chunks) from a graph and the new prompts eagerly, as two passes; every request's tokens equal
    those of a non-speculative engine without step graphs fed the same arrivals."""
    def run(model):
        e, out = model.engine, {}
        ids = [e.add_request(p, SHORT) for p in PROMPTS[:2]]
        for _ in range(3):
            for o in e.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        ids += [e.add_request(p, SHORT) for p in PROMPTS[2:]] + [e.add_request(PROMPTS[0][:7], SHORT)]
        while e.has_unfinished():
            for o in e.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return [out[i] for i in ids]

    ref = run(llm(preset))
    model = llm(preset, **(dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4) if spec else {}))
    g = with_steps(model)
    splits = []
    orig = model.engine._split
    model.engine._split = lambda chunks: splits.append(len(parts := orig(chunks))) or parts
    assert run(model) == ref
    assert 2 in splits and g.replayed > 0
