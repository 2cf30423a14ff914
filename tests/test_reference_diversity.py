"""`reference.output_diversity`: how varied an oracle reference's greedy outputs are (a model that
repeats one token for every prompt flatters a speculative round's retrieval union)."""

from __future__ import annotations

import pytest

from dhisparse.bench.reference import output_diversity


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
