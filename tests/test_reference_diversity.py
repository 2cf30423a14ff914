"""`reference.output_diversity`: how varied an oracle reference's greedy outputs are (a model that
repeats one token for every prompt flatters a speculative round's retrieval union)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dhisparse.bench.reference import CYCLE_SPAN, check_diversity, cycle_share, output_diversity


def test_a_repeated_token_for_every_prompt_reads_as_such():
    d = output_diversity({i: [11] + [34] * 9 for i in range(4)})
    assert d == {"n": 4, "distinct_ids": 2.0, "repeat_share": pytest.approx(8 / 9), "cycle_share": pytest.approx(8 / 9),
                 "cycle_periods": [1] * 4, "distinct_outputs": 1}


def test_varied_outputs():
    d = output_diversity({0: [1, 2, 3, 3], 1: [4, 5, 6, 7], 2: [1, 2, 3, 3]})
    assert d["distinct_ids"] == pytest.approx(10 / 3) and d["repeat_share"] == pytest.approx(2 / 9)
    assert d["distinct_outputs"] == 2 and d["n"] == 3


def test_empty_and_single_token_outputs():
    assert output_diversity({}) == {"n": 0, "distinct_ids": 0.0, "repeat_share": 0.0, "cycle_share": 0.0,
                                    "cycle_periods": [], "distinct_outputs": 0}
    one = output_diversity({0: [5], 1: [5]})
    assert one["repeat_share"] == 0.0 and one["cycle_share"] == 0.0 and one["cycle_periods"] == [0, 0]
    assert cycle_share([]) == (0.0, 0) and cycle_share([7, 7]) == (1.0, 1)


def test_a_short_cycle_reads_as_one_though_no_token_repeats_the_one_before():
    """Session 40's CPU build over a 16K prefix: four tokens over and over, 0% immediate repeats."""
    cycle = [9, 1, 2, 3] + [251, 191, 139, 242] * 30
    d = output_diversity({0: cycle, 1: cycle})
    assert d["repeat_share"] == 0.0
    assert d["cycle_share"] == pytest.approx(116 / 120) and d["cycle_periods"] == [4, 4]
    # the smallest period reaching the share: a period-4 cycle also matches at 8, 12 and 16
    assert cycle_share([1, 2] * 20) == (1.0, 2)
    # past the span it is not seen
    assert cycle_share(list(range(CYCLE_SPAN + 1)) * 4)[0] == 0.0
    assert cycle_share(list(range(CYCLE_SPAN)) * 4) == (1.0, CYCLE_SPAN)


def test_byte_text_is_well_under_the_default_limit():
    """The default limit (gpu_serving's 0.25) sits above natural text: this repository's README, as
    bytes, 1,024 at a time."""
    from bench.gpu_serving import parse

    text = list((Path(__file__).resolve().parents[1] / "README.md").read_bytes())
    windows = [text[i:i + 1024] for i in range(0, min(len(text), 16384) - 1023, 1024)]
    assert windows
    limit = parse(["--presets", "hisparse"]).max_reference_repeat
    assert all(cycle_share(w)[0] < limit for w in windows)


def test_a_degenerate_reference_is_refused_by_name():
    """gpu_serving refuses a reference whose tokens mostly repeat (sessions 36-37's glm5-faithful output)
    before any window runs; a varied one, an empty one and a limit of 1.0 pass."""
    bad = output_diversity({i: [11] + [34] * 9 for i in range(4)})
    with pytest.raises(ValueError, match="--max-reference-repeat"):
        check_diversity(bad, 0.5)
    check_diversity(bad, 1.0)
    check_diversity(output_diversity({0: [1, 2, 3, 3], 1: [4, 5, 6, 7]}), 0.5)
    check_diversity(output_diversity({}), 0.0)
    cyc = output_diversity({0: [3, 4, 5] * 20})
    with pytest.raises(ValueError, match=r"d \[3\]"):
        check_diversity(cyc, 0.5)
    # a result written before cycle_share existed is judged by its repeat_share
    check_diversity({"n": 2, "repeat_share": 0.1, "distinct_ids": 9.0, "distinct_outputs": 2}, 0.5)
    with pytest.raises(ValueError, match="--max-reference-repeat"):
        check_diversity({"n": 2, "repeat_share": 0.6, "distinct_ids": 2.0, "distinct_outputs": 1}, 0.5)


def test_gpu_serving_takes_the_limit():
    from bench import gpu_serving

    assert gpu_serving.parse(["--presets", "hisparse"]).max_reference_repeat == 0.25
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
    monkeypatch.setattr(gpu_serving, "decode_reference", lambda *a: {i: [40 + i] + list(range(50, 80)) for i in range(3)})
    assert len(gpu_serving.oracle_reference(ns, {}, loaded, None)) == 3
