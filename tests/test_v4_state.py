"""V4 streaming state: bounded tails, exact row bookkeeping, rollback / snapshot rules, row causality,
and the stored rows equal transformers' own cache contents."""

from __future__ import annotations

import pytest
import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.kv.v4.rows import DenseRowStore
from dhisparse.kv.v4.state import StateError
from dhisparse.layers.v4_attention import all_complete_rows
from dhisparse.models.dsv4 import DeepseekV4ForCausalLM
from dhisparse.core.v4_config import V4Config
from v4_fixtures import build_v4_hf, new_state, one_thread, prompt_ids, step, v4_config

pytest.importorskip("transformers")
_threads = pytest.fixture(scope="module", autouse=True)(one_thread)


@pytest.fixture(scope="module")
def models():
    hf = build_v4_hf(v4_config(), seed=4)
    ours = DeepseekV4ForCausalLM(V4Config.from_hf(hf.config.to_dict()))
    ours.load_state_dict(hf.state_dict())
    return ours.eval(), hf


def test_tails_stay_bounded_and_rows_counted(models):
    lm, _ = models
    cache, st = new_state(lm)
    step(lm, cache, st, prompt_ids(11, seed=1))
    for t in prompt_ids(30, seed=2):
        step(lm, cache, st, [t])
        n = st.length
        for i, ls in enumerate(st.layers):
            assert ls.window.end == n and ls.window.rows.shape[0] == min(n, 7)
            if ls.m:
                held = n - ls.kv_raw.start
                assert held == n % ls.m + (ls.m if ls.overlap and n >= ls.m else 0)
                assert st.rows(i, "kv") == n // ls.m
        assert st.rows(1, "index") == n // 4 and st.rows(2, "index") == 0


def test_rows_and_window_equal_transformers_cache(models):
    lm, hf = models
    ids = prompt_ids(27, seed=3)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
    cache_hf = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    cache, st = new_state(lm)
    step(lm, cache, st, ids[:10])
    step(lm, cache, st, ids[10:])
    for i in range(4):
        layer = cache_hf.layers[i]
        torch.testing.assert_close(st.layers[i].window.rows, layer.keys[0, 0], rtol=1e-4, atol=1e-5)
        if i:
            torch.testing.assert_close(cache.store.read(0, i, "kv"), layer.compressed_kv["compressor"][0],
                                       rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.store.read(0, 1, "index"), cache_hf.layers[1].compressed_kv["indexer"][0],
                               rtol=1e-4, atol=1e-5)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
    for i, name, kind in ((1, "compressor", "kv"), (1, "indexer", "index"), (2, "compressor", "kv")):
        view, layer = st.compressor_view(i, kind), cache_hf.layers[i]
        close(view.buffer_kv, layer.buffer_kv[name][0])
        close(view.buffer_gate, layer.buffer_gate[name][0])
        if i == 1:
            attn = hf.model.layers[i].self_attn.compressor
            ape = (attn if kind == "kv" else attn.indexer).position_bias
            close(view.overlap_kv, layer.overlap_kv[name][0])
            close(view.overlap_gate + ape[:, : view.overlap_kv.shape[1]], layer.overlap_gate[name][0])


def test_rollback_and_commit_rules(models):
    lm, _ = models
    cache, st = new_state(lm, auto_commit=False)
    step(lm, cache, st, prompt_ids(10, seed=4))
    st.commit(9)
    with pytest.raises(StateError, match="rollback"):
        st.rollback(8)
    with pytest.raises(StateError, match="commit"):
        st.commit(11)
    st.rollback(9)
    assert st.length == 9 and st.rows(1, "kv") == 2 and st.rows(2, "kv") == 1
    batch = ForwardBatch.build([([5], 10)])
    with pytest.raises(StateError, match="position 10"):
        cache.begin(batch, [st])


def test_stale_snapshot_is_refused(models):
    lm, _ = models
    cache, st = new_state(lm, auto_commit=False)
    step(lm, cache, st, prompt_ids(9, seed=5))
    snap = st.snapshot()
    step(lm, cache, st, [7, 8, 9])
    st.restore(snap)
    st.restore(snap)  # restoring twice is fine
    st.rollback(6)
    with pytest.raises(StateError, match="stale"):
        st.restore(snap)


def test_release_drops_rows(models):
    lm, _ = models
    cache, st = new_state(lm)
    step(lm, cache, st, prompt_ids(12, seed=6))
    assert st.rows(1, "kv") == 3
    st.release()
    assert st.rows(1, "kv") == 0 and cache.store.rows == {}


def test_row_causality_rule():
    """Query at t may use row w only if (w+1)*m <= t+1."""
    sel = all_complete_rows(torch.tensor([0, 2, 3, 6, 7, 8]), 4)
    assert sel.tolist() == [[-1, -1], [-1, -1], [0, -1], [0, -1], [0, 1], [0, 1]]


def test_dense_store_locate():
    store = DenseRowStore({"kv": 2})
    store.append("a", 0, "kv", torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    store.append("b", 0, "kv", torch.tensor([[3.0, 3.0]]))
    rows, loc = store.locate(0, "kv", ["a", "b"], torch.tensor([0, 1]), torch.tensor([[1, -1], [0, -1]]))
    assert loc.tolist() == [[1, -1], [2, -1]] and rows[0, 2].tolist() == [3.0, 3.0]
    store.truncate("a", 0, "kv", 1)
    assert store.count("a", 0, "kv") == 1
    with pytest.raises(ValueError, match="width"):
        store.append("a", 0, "kv", torch.zeros(1, 3))
