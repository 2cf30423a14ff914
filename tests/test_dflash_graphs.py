"""The DFlash drafter's block pass from per-bucket graphs (spec/dflash_graphs.py), replayed on CPU by
`EagerRunner` (same static inputs, bucketing and padding; CUDA capture is the CUDA run's): drafts and
logits equal the eager path's round after round, padding rows never trip the liveness check, a
window that is not yet full runs eagerly, a stale ring row still raises, and a shifted window or
unmasked padding fails these checks. The commits' context projection from row-bucket graphs
(`IngestGraphs`) writes the eager ring; breakages tried (session 45, CAUGHT): the features not
copied into the static rows, the bucket's whole output returned instead of its first n rows, the
layers' (k, v) handed to the ring in reverse order, and static positions not refreshed (a test)."""

from __future__ import annotations

import pytest
import torch

from spec_loop import one_thread  # noqa: F401

from dhisparse.models.graphs import EagerRunner
from dhisparse.models.tiny import build_tiny
from dhisparse.spec.dflash import DFlashDrafter
from dhisparse.spec.drafter import Commit, DraftRequest
from dhisparse.spec.factory import random_dflash_config

pytestmark = pytest.mark.usefixtures("one_thread")
W, HIDDEN = 12, 64


@pytest.fixture(scope="module")
def target():
    return build_tiny(seed=0)


def pair(target, kind: str = "dflash2", slots: int = 6, runner=None):
    """(eager drafter, graphed drafter) with the same seeded weights (graphs replayed by `runner`,
    default `EagerRunner`)."""
    cfg = random_dflash_config(target, block_size=5, num_layers=2, kind=kind)
    make = lambda: DFlashDrafter.random(cfg, target, seed=3, window=W, page=4, k_max=4, max_requests=slots)  # noqa: E731
    eager, graphed = make(), make()
    assert graphed.use_graphs(runner or EagerRunner(), slots)
    return eager, graphed


def feats(layers, rows: int, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {l: torch.randn(rows, HIDDEN, generator=g) for l in layers}


class Rounds:
    """`requests` requests with `lens` committed positions each, drafted and committed in lockstep
    on every drafter given (the same features and accepted counts)."""

    def __init__(self, drafters, lens: list[int], seed: int = 0) -> None:
        self.ds, self.n, self.seed = drafters, {f"r{i}": n for i, n in enumerate(lens)}, seed
        for i, (rid, n) in enumerate(self.n.items()):
            f = feats(drafters[0].capture_layers, n, seed * 100 + i)
            for d in drafters:
                d.observe(rid, f, 0)

    def requests(self, width: int = 4) -> list[DraftRequest]:
        return [DraftRequest(r, [(3 * i + 1) % 200 for i in range(n)], (n * 7) % 200, width) for r, n in self.n.items()]

    def step(self, k: int) -> list:
        """One round on every drafter -> each drafter's (tokens, confidences, logits)."""
        reqs, out = self.requests(), []
        for d in self.ds:
            states = [d._states[r.request_id] for r in reqs]
            _, logits, _ = d._draft_logits(reqs, states)
            props = d.propose(reqs)
            out.append(([p.tokens for p in props], [p.confidences for p in props], logits.clone()))
        acc = [(k + i) % 4 for i in range(len(reqs))]
        for d in self.ds:
            f = {r.request_id: feats(d.capture_layers, a + 1, 1000 * k + i) for i, (r, a) in enumerate(zip(reqs, acc))}
            assert not any(d.commit_many([Commit(r.request_id, a, f[r.request_id]) for r, a in zip(reqs, acc)]))
        for r, a in zip(reqs, acc):
            self.n[r.request_id] += a + 1
        return out


def same(a, b) -> bool:
    return a[0] == b[0] and torch.allclose(torch.tensor(a[1]), torch.tensor(b[1]), atol=1e-5) and \
        torch.allclose(a[2], b[2], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_cuda_graph_replays_equal_eager_rounds(kind):
    """The same rounds with real CUDA graphs (`CudaGraphRunner`, captured on first use of a bucket)
    on the GPU: fp32 weights give the eager drafts; bf16 weights logits within bf16 rounding (the
    padded bucket may pick other GEMM kernels, so near-tied drafts may differ there)."""
    from dhisparse.models.graphs import CudaGraphRunner

    for dtype in (torch.float32, torch.bfloat16):
        target = build_tiny(seed=0, dtype=dtype, device="cuda")
        eager, graphed = pair(target, kind, runner=CudaGraphRunner())  # every bucket captured, over padding only
        assert graphed.stats()["drafter_graph_buckets"] == 4
        rounds = Rounds([eager, graphed], [20, 31, 15])
        for k in range(6):
            a, b = rounds.step(k)
            err = float((a[2] - b[2]).abs().max() / a[2].abs().max())
            assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), (dtype, k, err)
            assert dtype == torch.bfloat16 or a[0] == b[0], k
        assert graphed.stats()["drafter_graph_replays"] == 12


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
@pytest.mark.parametrize("lens", [[20], [20, 31, 15], [40, 13, 25, 17, 19]], ids=["one", "three", "five"])
def test_graphed_rounds_equal_eager_rounds(target, kind, lens):
    """1 -> bucket 1; 3 -> bucket 4 and 5 -> bucket 6 (the ring's 6 slots) pad rows that
    read slot 0's rows at positions it no longer holds: the liveness check must skip them."""
    eager, graphed = pair(target, kind)
    rounds = Rounds([eager, graphed], lens)
    for k in range(6):
        a, b = rounds.step(k)
        assert same(a, b), (k, a[0], b[0])
    c = graphed.stats()
    assert c["drafter_graph_replays"] == 12 and c["drafter_graph_eager"] == 0 and c["drafter_graph_buckets"] == 4


def test_a_window_not_yet_full_runs_eagerly(target):
    eager, graphed = pair(target)
    rounds = Rounds([eager, graphed], [20, W - 3])
    for k in range(3):
        a, b = rounds.step(k)
        assert same(a, b)
    c = graphed.stats()
    assert c["drafter_graph_eager"] >= 2 and c["drafter_graph_replays"] >= 1  # full once the short one grows


def test_every_bucket_is_captured_up_front_and_larger_rounds_run_eagerly(target):
    eager, graphed = pair(target)
    assert graphed.stats()["drafter_graph_buckets"] == 4  # 1, 2, 4, 6: before any round
    assert graphed.use_graphs(EagerRunner(), 2) and graphed.graphs.buckets == (1, 2)  # rounds of up to 2 requests
    rounds = Rounds([eager, graphed], [20, 31, 15])
    a, b = rounds.step(0)
    assert same(a, b) and graphed.stats()["drafter_graph_replays"] == 0 and graphed.stats()["drafter_graph_eager"] == 2
    eager, graphed = pair(target)
    assert graphed.use_graphs(EagerRunner(), 2)
    rounds = Rounds([eager, graphed], [22, 30])
    a, b = rounds.step(1)
    assert same(a, b) and graphed.stats()["drafter_graph_replays"] == 2


def test_the_largest_bucket_is_the_limit(target):
    _, graphed = pair(target, slots=3)
    assert graphed.graphs.buckets == (1, 2, 3) and graphed.graphs.bucket(3) == 3 and graphed.graphs.bucket(0) is None
    _, graphed = pair(target, slots=64)
    assert graphed.graphs.buckets[-3:] == (32, 48, 64)
    assert graphed.use_graphs(EagerRunner(), 100) and graphed.graphs.buckets[-1] == 64  # never above the ring's slots


@pytest.mark.parametrize("path", ["graphed", "eager"])
def test_a_stale_ring_row_raises(target, path):
    """I6's check, once a round for every layer (`DraftKVRing.stale`), in both paths."""
    d = dict(zip(("eager", "graphed"), pair(target)))[path]
    rounds = Rounds([d], [20, 24])
    rounds.step(0)
    slot = d._states["r1"].slot
    d.kv.tags[1, slot * d.ring_rows + 15] = -7  # a live row of r1's window now "holds" another position (layer 1)
    with pytest.raises(RuntimeError, match="no longer live"):
        d.propose(rounds.requests())


def test_breakages_fail(target, monkeypatch):
    """Mutation checks: a window shifted by one position changes the logits; padding rows counted
    as real trip the liveness check."""
    eager, graphed = pair(target)
    graphed.graphs.window = W - 1
    rounds = Rounds([eager, graphed], [20, 31, 15])
    a, b = rounds.step(0)
    assert not same(a, b)
    _, graphed = pair(target)
    rounds = Rounds([graphed], [20, 31, 15])
    host = graphed.graphs._host
    monkeypatch.setattr(graphed.graphs, "_host", lambda *a: host(*a).index_fill_(0, torch.tensor([3]), 1))
    with pytest.raises(RuntimeError, match="no longer live"):
        for k in range(6):
            rounds.step(k)


def ring_of(d: DFlashDrafter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.stack(d.kv.k), torch.stack(d.kv.v), d.kv.tags.clone()


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_graphed_commits_write_the_eager_ring(target, kind):
    """The commits' context projection from row-bucket graphs (`IngestGraphs`: 13 rows -> bucket 16,
    padding rows holding an earlier round's features) leaves the ring the eager projection leaves,
    round after round; observes above the largest bucket (6 slots x block 5 = 30 rows) run eagerly."""
    eager, graphed = pair(target, kind)
    ig = graphed.ingest_graphs
    assert ig.buckets == (1, 2, 4, 8, 12, 16, 24, 30) and ig.counters()["drafter_ingest_graph_buckets"] == 8
    rounds = Rounds([eager, graphed], [20, 31, 15])  # three observes of W = 12 kept rows: bucket 12
    assert ig.replayed == 3 and ig.eager == 0
    for k in range(5):
        a, b = rounds.step(k)
        assert same(a, b), k
        for x, y in zip(ring_of(eager), ring_of(graphed)):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), k
    assert ig.replayed == 3 + 5 and graphed.stats()["drafter_ingest_graph_replays"] == 8
    f = {l: torch.randn(31, HIDDEN) for l in graphed.capture_layers}
    for d in (eager, graphed):
        d.observe("big", f, 0)  # 12 kept rows again: replayed
    assert ig.replayed == 9 and ig.eager == 0
    for x, y in zip(ring_of(eager), ring_of(graphed)):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    wide = feats(graphed.capture_layers, 40, 7)
    big = DFlashDrafter.random(graphed.cfg, target, seed=3, window=40, page=4, k_max=4, max_requests=1)
    assert big.use_graphs(EagerRunner(), 1) and big.ingest_graphs.buckets == (1, 2, 4, 5)
    big.observe("w", wide, 0)  # 40 kept rows > 5: eager
    assert big.ingest_graphs.eager == 1 and big.ingest_graphs.replayed == 0


def test_ingest_breakages_fail(target, monkeypatch):
    """Mutation check: a replay that keeps the previous round's positions (the static positions not
    refreshed) ropes the keys at the wrong positions, and the ring differs from the eager one."""
    eager, graphed = pair(target)
    ig = graphed.ingest_graphs
    rounds = Rounds([eager, graphed], [20, 31, 15])
    real = ig._pos
    monkeypatch.setattr(ig, "_pos", real.clone())  # the graphs read `real`; the copy lands elsewhere
    rounds.step(0)
    k_e, _, _ = ring_of(eager)
    k_g, _, _ = ring_of(graphed)
    assert not torch.allclose(k_e, k_g, rtol=1e-5, atol=1e-6)
