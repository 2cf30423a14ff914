"""DeepSeek-V4 parity with transformers 5.24 on tiny random configs (CPU, fp32).

Config: layers sliding / CSA (m=4, indexer top-3 of 8 heads) / HCA (m=8) / CSA, window 8. Prompts
are not multiples of m; decoding crosses window and compression boundaries; a CSA query has more
complete rows than index_topk after position 15, so the sparse selection matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.models.v4_loader import load_v4_checkpoint
from v4_fixtures import (
    build_v4_hf, chunked_logits, greedy_hf, greedy_v4, load_v4_hf, new_state, one_thread, prompt_ids, save_upstream,
    step, upstream_v4_config, v4_config,
)

pytest.importorskip("transformers")
_threads = pytest.fixture(scope="module", autouse=True)(one_thread)


@dataclass
class Pair:
    ours: object  # DeepseekV4ForCausalLM
    hf: object  # transformers DeepseekV4ForCausalLM
    folder: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    folder = tmp_path_factory.mktemp("v4") / "hf"
    build_v4_hf(v4_config(), seed=1).save_pretrained(folder)
    return Pair(load_v4_checkpoint(folder).model, load_v4_hf(folder), folder)


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max abs err {err} vs max |ref| {ref.abs().max().item()}"


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("n", [13, 22, 30])
def test_prefill_matches_transformers(pair, n):
    ids = prompt_ids(n, seed=n)
    _close(chunked_logits(pair.ours, [ids]), _hf_logits(pair.hf, ids))


def test_sparse_selection_is_exercised(pair):
    """Same weights with index_topk >= rows gives different logits once rows exceed top-k."""
    ids = prompt_ids(30, seed=30)
    dense = load_v4_checkpoint(pair.folder).model
    for layer in dense.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            comp.indexer.topk = 64
    a, b = chunked_logits(pair.ours, [ids]), chunked_logits(dense, [ids])
    _close(a[:15], b[:15], rel=1e-6)  # <= 3 CSA rows: top-3 is everything
    assert (a[15:] - b[15:]).abs().max() > 0.05


def test_upstream_keys_yarn_prefill(tmp_path):
    d = upstream_v4_config()
    hf = build_v4_hf(d, seed=2)
    lm = load_v4_checkpoint(save_upstream(hf, tmp_path / "up", d))
    assert lm.config.rope_compress.rope_type == "yarn" and lm.config.hca_rate == 8
    ids = prompt_ids(22, seed=5)
    _close(chunked_logits(lm.model, [ids]), _hf_logits(hf, ids))


def test_greedy_decode_matches_generate(pair):
    prompt = prompt_ids(13, seed=7)
    ref = greedy_hf(pair.hf, prompt, 28)
    assert greedy_v4(pair.ours, prompt, 28, ban=(2,)) == ref
    assert len(set(ref)) > 5


def test_decode_logits_match_one_shot(pair):
    """Token-by-token decode across window / row boundaries == transformers on the full sequence."""
    ids = prompt_ids(34, seed=8)
    cache, st = new_state(pair.ours)
    got = torch.cat([step(pair.ours, cache, st, ids[:11])] + [step(pair.ours, cache, st, [t]) for t in ids[11:]])
    _close(got, _hf_logits(pair.hf, ids))


def test_chunked_prefill_equals_one_shot(pair):
    ids = prompt_ids(22, seed=9)
    one = chunked_logits(pair.ours, [ids])
    for cuts in ([5, 14], [3, 4, 12], [8, 16]):
        chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        _close(chunked_logits(pair.ours, chunks), one, rel=1e-5)


def test_mixed_batch_equals_separate_runs(pair):
    """One ForwardBatch holding a prefill chunk of request A and a decode token of request B."""
    lm = pair.ours
    a, b = prompt_ids(17, seed=10), prompt_ids(10, seed=11)
    cache, sa = new_state(lm, "a")
    sb = cache.new_request("b")
    step(lm, cache, sa, a[:6])
    step(lm, cache, sb, b[:9])
    batch = ForwardBatch.build([(a[6:], 6), (b[9:], 9)])
    got = lm.logits(lm(batch, cache.begin(batch, [sa, sb])).hidden)
    _close(got[:11], chunked_logits(lm, [a])[6:], rel=1e-5)
    _close(got[11:], chunked_logits(lm, [b])[9:], rel=1e-5)


@pytest.mark.parametrize("keep", [13, 14, 15, 17])
def test_rollback_inside_window(pair, keep):
    """Prefill 13, verify a 6-token draft (crosses the CSA boundary 16 and HCA boundary 16), keep
    `keep` tokens, continue: logits equal a run that never took the detour."""
    lm = pair.ours
    prompt, draft, cont = prompt_ids(13, seed=12), prompt_ids(6, seed=13), prompt_ids(9, seed=14)
    cache, st = new_state(lm, auto_commit=False)
    step(lm, cache, st, prompt)
    st.commit(13)
    step(lm, cache, st, draft)
    assert st.rows(1, "kv") == 4 and st.rows(2, "kv") == 2
    st.rollback(keep)
    assert st.rows(1, "kv") == keep // 4 and st.rows(1, "index") == keep // 4 and st.rows(2, "kv") == keep // 8
    got = step(lm, cache, st, cont)
    ref = chunked_logits(lm, [prompt + draft[: keep - 13] + cont])[-len(cont):]
    _close(got, ref, rel=1e-5)


def test_snapshot_restore_equals_no_detour(pair):
    lm = pair.ours
    prompt, draft, cont = prompt_ids(14, seed=15), prompt_ids(5, seed=16), prompt_ids(7, seed=17)
    cache, st = new_state(lm)
    step(lm, cache, st, prompt)
    snap = st.snapshot()
    step(lm, cache, st, draft)
    step(lm, cache, st, draft[:2])
    st.restore(snap)
    got = step(lm, cache, st, cont)
    _close(got, chunked_logits(lm, [prompt + cont])[-len(cont):], rel=1e-5)
