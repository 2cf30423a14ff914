"""Layer-wise prefetch of follower layers on a side stream (kv/hier/prefetch.py, issue 26 item 2).

On CPU there is no side stream, so the tests install a fake `Streams` whose copies run either at
issue (as early as a side stream could) or only when the compute stream waits for them (as late
as it could). Either way every located row must be the right one (I2, `kv_check.checked`) and the
tokens those of `resident`. The tiny model's groups: layer 1 with followers 2, 3; layer 4 with
follower 5; layer 0 alone. The deferred plans need the Triton resolver (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.llm import LLM
from dhisparse.kv.hier.prefetch import LayerPrefetch, make_prefetch
from kv_check import checked

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(30 + 11 * i)] for i in range(2)]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)

try:
    import dhisparse.kernels.resolver  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="the deferred resolver needs Triton")


class FakeStreams:
    """A side stream whose copies run at issue (`late` False) or only when waited on (`late`)."""

    def __init__(self, late: bool) -> None:
        self.late, self.log = late, []

    def fence(self) -> str:
        self.log.append("fence")
        return "fence"

    def on_side(self, after, fn) -> list:
        ev = [fn]
        if not self.late:
            self._run(ev)
        return ev

    def _run(self, ev: list) -> None:
        if ev[0] is not None:
            ev[0]()
            ev[0] = None
            self.log.append("copy")

    def finished(self, ev: list) -> bool:
        return ev[0] is None

    def wait(self, ev: list) -> None:
        self._run(ev)
        self.log.append("wait")


def llm(preset: str, **kw) -> LLM:
    kw.setdefault("resolver", "triton" if preset != "resident" else "auto")
    return LLM("tiny", preset=preset, page_size=4, hot_cache_rows=16, cuda_graphs="none", debug_checks=True, **kw)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in llm("resident").generate(PROMPTS, GREEDY)]


def with_prefetch(model: LLM, late: bool) -> LayerPrefetch:
    store = model.engine.store
    store.prefetch = LayerPrefetch(FakeStreams(late))
    return store.prefetch


def test_layer_prefetch_waits_per_layer_and_drains_leftovers():
    ran: list[int] = []
    pf = LayerPrefetch(FakeStreams(late=True))
    pf.issue({2: lambda: ran.append(2), 3: lambda: ran.append(3)})
    pf.wait(3)
    assert ran == [3] and list(pf.pending) == [2]  # layer 3's wait does not wait for layer 2's copy
    pf.issue({5: lambda: ran.append(5)})  # a pass that never reached layer 2: its copy is waited on first
    assert ran == [3, 2] and list(pf.pending) == [5] and pf.issued == 3
    pf.wait(7)  # a layer with nothing pending
    pf.drain()
    assert ran == [3, 2, 5] and not pf.pending


def test_prefetch_stream_setting():
    assert make_prefetch(torch.device("cpu"), "side") is None  # no side stream off CUDA
    assert make_prefetch(torch.device("cpu"), "compute") is None
    with pytest.raises(ValueError, match="prefetch_stream"):
        make_prefetch(torch.device("cpu"), "sideways")
    with pytest.raises(ConfigValueError, match="prefetch_stream"):
        EngineConfig(prefetch_stream="early")
    assert EngineConfig(preset="hisparse", prefetch_stream="side").store_settings().prefetch_stream == "side"


@needs_triton
@pytest.mark.parametrize("preset,late", [("hisparse", True), ("hisparse", False), ("adaptive", True)])
def test_followers_read_their_prefetched_rows_exactly(preset, late, reference):
    """Followers' copies issued by the producer on the (fake) side stream, run at issue or only at
    the follower's wait: every located row is checked (I2) and the tokens equal resident's.
    (adaptive with the paper's decode-page rule: decode rows come back through the hot cache, so
    its passes are not all-direct and the resolver plans.)"""
    model = checked(llm(preset, **({"decode_pages": "hot-cache"} if preset == "adaptive" else {})))
    pf = with_prefetch(model, late)
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert pf.issued > 0 and not pf.pending
    assert model.engine.store.followers == [[], [2, 3], [5]]


@needs_triton
def test_prefetch_covers_verification_rounds(reference):
    """Speculative rounds (K = 4 queries a request, unions staged past a 16-row hot cache) with
    follower copies on the late side stream: exact, and the staging path was taken."""
    from dhisparse.engine.engine import Engine

    model = LLM.__new__(LLM)
    model.engine = Engine(EngineConfig(preset="hisparse", resolver="triton", page_size=4, hot_cache_rows=16,
                                       cuda_graphs="none", debug_checks=True, speculative_algorithm="oracle",
                                       speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=2.5),
                          oracle_reference={tuple(p): r for p, r in zip(PROMPTS, reference)})
    model = checked(model)
    pf = with_prefetch(model, late=True)
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert pf.issued > 0 and model.engine.stats().as_dict()["resolver_overflow"] > 0


@needs_triton
def test_a_follower_that_does_not_wait_reads_stale_rows(monkeypatch, reference):
    """Mutation check: a follower that skips its wait reads its hot-cache slots before the late
    copy lands; the row checker (I2) catches it."""
    model = checked(llm("hisparse"))
    with_prefetch(model, late=True)
    monkeypatch.setattr(LayerPrefetch, "wait", lambda self, layer: self.pending.pop(layer, None))
    with pytest.raises(AssertionError):
        model.generate(PROMPTS, GREEDY)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real side stream needs CUDA")
@pytest.mark.parametrize("graphs", ["none", "step"])
def test_side_stream_prefetch_on_cuda_is_exact(graphs, reference):
    """The real thing: CUDA side stream and events, eager and inside whole-step graphs (the side
    branch forks from and joins back into the capture stream within the pass)."""
    model = checked(LLM("tiny", preset="hisparse", page_size=4, hot_cache_rows=16, cuda_graphs=graphs,
                        prefetch_stream="side", device="cuda"))
    pf = model.engine.store.prefetch
    assert isinstance(pf, LayerPrefetch)
    assert [o.token_ids for o in model.generate(PROMPTS, GREEDY)] == reference
    assert pf.issued > 0 and not pf.pending
