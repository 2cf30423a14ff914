"""`KVStore.row_place`: the one answer to "where does row p of request r live" (issue 23 item 5).

An engine runs greedy prompts with every stored row mirrored into a DenseKV (tests/kv_check.py;
the mirror also checks every located selection, I2). After every step, every written position of
every running request is read where the store's `row_place` says it lives (device row space) and
compared bit for bit with the mirror, and its host copy, when reported, equals it too (I1). A
locator that is wrong about one tier fails the test (mutation below)."""

from __future__ import annotations

import collections

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.core.rows import gather_rows
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.resident.dense import DenseKV
from kv_check import CheckedContext

PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(37 + 19 * i)] for i in range(3)]
LAYERS = (0, 2)


def _engine(preset: str, **kw) -> Engine:
    return Engine(EngineConfig(preset=preset, device="cpu", page_size=4, hot_cache_rows=16, max_model_len=256, max_num_batched_tokens=24,
                               kv_pool_bytes=kw.pop("kv_pool_bytes", 8 << 20), host_pool_bytes=8 << 20, **kw))


def _row(store, place, layer: int) -> torch.Tensor:
    return gather_rows(store.arena.latent_rows(layer), torch.tensor([place.device]))[0]


def _host_row(store, place, layer: int) -> torch.Tensor:
    return gather_rows(store.host.layer_rows(layer), torch.tensor([place.host]))[0]


def _mirrored(eng: Engine) -> tuple[DenseKV, dict]:
    """Every row the engine's passes store is mirrored into a DenseKV (slot per request id)."""
    dense, names, orig = DenseKV(eng.model_config), {}, eng.store.context

    def context(batch, reqs):
        return CheckedContext(orig(batch, reqs), dense, batch, [names.setdefault(r, len(names)) for r in reqs])

    eng.store.context = context
    return dense, names


def lockstep(preset: str, steps: int = 40, **kw) -> collections.Counter:
    """Run `preset` over the prompts; after every step check every written row of every running
    request through `row_place` against the mirror; return the tiers seen."""
    eng = _engine(preset, **kw)
    dense, names = _mirrored(eng)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, params, request_id=f"r{i}")
    seen: collections.Counter = collections.Counter()
    for _ in range(steps):
        if not eng.has_unfinished():
            break
        eng.step()
        for rid, req in eng.requests.items():
            if rid not in eng.store.reqs:
                continue  # waiting for admission
            for layer in LAYERS:
                mirror = dense.latent.get((names.get(rid), layer))
                for p in range(req.num_computed):
                    place = eng.store.row_place(rid, p, layer)
                    want = mirror[p]
                    seen[place.tier] += 1
                    assert place.device >= 0 or place.host >= 0, (rid, p, place)
                    if place.device >= 0:
                        assert torch.equal(_row(eng.store, place, layer), want), (rid, p, layer, place)
                    if place.host >= 0:
                        assert torch.equal(_host_row(eng.store, place, layer), want), (rid, p, layer, place)
    seen["reclaimed"] = eng.stats().as_dict().get("reclaimed_pages", 0)
    return seen


def test_hisparse_rows_are_where_row_place_says():
    seen = lockstep("hisparse")
    assert {"workspace", "tail", "hot", "host"} <= set(seen)


def test_adaptive_rows_are_where_row_place_says():
    seen = lockstep("adaptive")
    assert {"workspace", "tail", "optional"} <= set(seen)


def test_adaptive_under_reclaim():
    """A small pool: optional history is reclaimed and rows fall back to the hot cache / host."""
    seen = lockstep("adaptive", kv_pool_bytes=_pages_bytes(70))
    assert {"tail", "host", "optional"} <= set(seen) and seen["reclaimed"] > 0


def _pages_bytes(n: int) -> int:
    eng = _engine("resident")
    return n * eng.page_bytes


def test_row_place_mutations_fail(monkeypatch):
    """A locator that is off by one position in the tail, or reads the hot cache of another
    group, fails the lockstep check."""
    orig = HierarchicalKV.row_place

    def tail_off_by_one(self, req, position, layer=0):
        place = orig(self, req, position, layer)
        if place.tier == "tail" and position > self.reqs[req].tail_start:
            return orig(self, req, position - 1, layer)
        return place

    monkeypatch.setattr(HierarchicalKV, "row_place", tail_off_by_one)
    with pytest.raises(AssertionError):
        lockstep("hisparse", steps=12)


def test_resident_row_place():
    eng = _engine("resident")
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="a")
    eng.step()
    assert eng.store.row_place("a", 0).tier == "resident"
    assert eng.store.row_place("a", 10_000).tier == "none"
