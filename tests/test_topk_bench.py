"""bench/topk_bench.py at CPU size: both top-k forms give the same picks on indexer-like rows (exact
zeros, -0.0 among them, -inf tails), and the result file names its baseline and ratios."""

from __future__ import annotations

import json

import torch


def test_topk_bench_quick(tmp_path):
    from bench import topk_bench

    out = tmp_path / "tk.json"
    assert topk_bench.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["baseline"] == "stable_topk" and [c["rows"] for c in doc["cases"]] == [3, 5]
    for c in doc["cases"]:
        assert c["same_picks"] and set(c["median_ms"]) == {"stable", "packed", "lean"}
        assert len(c["packed_over_stable"]) == len(c["lean_over_stable"]) == 2


def test_scores_look_like_the_indexers():
    from bench.topk_bench import scores

    x = scores(4, 500, 0.3, torch.device("cpu"))
    zero = x == 0
    assert 0.2 < zero.float().mean() < 0.4 and torch.signbit(x[zero]).any() and (~torch.signbit(x[zero])).any()
    assert torch.isinf(x).any(dim=1).float().mean() > 0.5 and not (x == float("inf")).any()
