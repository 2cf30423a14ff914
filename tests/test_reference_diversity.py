"""`reference.output_diversity`: how varied an oracle reference's greedy outputs are (a model that
repeats one token for every prompt flatters a speculative round's retrieval union)."""

from __future__ import annotations

import pytest

from dhisparse.bench.reference import check_diversity, output_diversity


def test_a_repeated_token_for_every_prompt_reads_as_such():
    d = output_diversity({i: [11] + [34] * 9 for i in range(4)})
    assert d == {"n": 4, "distinct_ids": 2.0, "repeat_share": pytest.approx(8 / 9), "distinct_outputs": 1}


def test_varied_outputs():
    d = output_diversity({0: [1, 2, 3, 3], 1: [4, 5, 6, 7], 2: [1, 2, 3, 3]})
    assert d["distinct_ids"] == pytest.approx(10 / 3) and d["repeat_share"] == pytest.approx(2 / 9)
    assert d["distinct_outputs"] == 2 and d["n"] == 3


def test_empty_and_single_token_outputs():
    assert output_diversity({}) == {"n": 0, "distinct_ids": 0.0, "repeat_share": 0.0, "distinct_outputs": 0}
    assert output_diversity({0: [5], 1: [5]})["repeat_share"] == 0.0


def test_a_degenerate_reference_is_refused_by_name():
    """gpu_serving refuses a reference whose tokens mostly repeat (sessions 36-37's glm5-faithful output)
    before any window runs; a varied one, an empty one and a limit of 1.0 pass."""
    bad = output_diversity({i: [11] + [34] * 9 for i in range(4)})
    with pytest.raises(ValueError, match="--max-reference-repeat"):
        check_diversity(bad, 0.5)
    check_diversity(bad, 1.0)
    check_diversity(output_diversity({0: [1, 2, 3, 3], 1: [4, 5, 6, 7]}), 0.5)
    check_diversity(output_diversity({}), 0.0)


def test_gpu_serving_takes_the_limit():
    from bench import gpu_serving

    assert gpu_serving.parse(["--presets", "hisparse"]).max_reference_repeat == 0.5
    assert gpu_serving.parse(["--presets", "hisparse", "--max-reference-repeat", "1"]).max_reference_repeat == 1.0


def test_gpu_serving_stops_on_a_degenerate_reference(monkeypatch):
    """`oracle_reference` checks the reference it decoded before returning it (no window runs)."""
    from types import SimpleNamespace

    from bench import gpu_serving
    from dhisparse.models.tokenizer import ByteTokenizer

    ns = gpu_serving.parse(["--presets", "hisparse", "--input-len", "16", "--distinct-suffixes", "3"])
    loaded = SimpleNamespace(tokenizer=ByteTokenizer(), config=SimpleNamespace(vocab_size=259))
    monkeypatch.setattr(gpu_serving, "decode_reference", lambda *a: {i: [40] * 8 for i in range(3)})
    with pytest.raises(ValueError, match="--max-reference-repeat"):
        gpu_serving.oracle_reference(ns, {}, loaded, None)
    monkeypatch.setattr(gpu_serving, "decode_reference", lambda *a: {i: [40 + i, 41, 42, 43] for i in range(3)})
    assert len(gpu_serving.oracle_reference(ns, {}, loaded, None)) == 3
