"""StopChecker: EOS / stop ids / max_tokens / stop strings with held-back streaming text."""

from __future__ import annotations

import pytest

from dhisparse.core.params import SamplingParams
from dhisparse.engine.stops import StopChecker, StopUpdate

EOS = 99
MULTI = {26: "ab", 27: "cde", 28: "", 29: "\n\n", 30: "xyz"}  # multi-char and empty pieces


class FakeDetok:
    """id i -> chr('a' + i % 26), except the multi-character pieces in MULTI."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def add(self, token_id: int) -> str:
        self.seen.append(token_id)
        return MULTI.get(token_id, chr(ord("a") + token_id % 26))


def ids(text: str) -> list[int]:
    return [ord(c) - ord("a") for c in text]


def run(params: SamplingParams, tokens: list[int], eos=(EOS,)) -> tuple[StopChecker, list[StopUpdate]]:
    checker = StopChecker(params, eos, FakeDetok())
    updates = []
    for t in tokens:
        updates.append(checker.update(t))
        if updates[-1].finished:
            break
    assert "".join(u.text_delta for u in updates) == checker.text
    return checker, updates


def test_eos_finishes_without_text():
    c, ups = run(SamplingParams(max_tokens=10), ids("hi") + [EOS, 0])
    assert ups[-1] == StopUpdate(True, "stop", "", EOS)
    assert c.text == "hi" and c.num_tokens == 3 and len(ups) == 3
    assert EOS not in c.detok.seen


def test_stop_token_id():
    c, ups = run(SamplingParams(max_tokens=10, stop_token_ids=(7,)), ids("abc") + [7])
    assert ups[-1] == StopUpdate(True, "stop", "", 7)
    assert c.text == "abc"


def test_ignore_eos_keeps_going_until_length():
    c, ups = run(SamplingParams(max_tokens=3, ignore_eos=True), [0, EOS, 1, 2])
    assert [u.finished for u in ups] == [False, False, True]
    assert ups[-1].reason == "length" and ups[-1].stop_reason is None
    assert c.num_tokens == 3 and c.text == "a" + chr(ord("a") + EOS % 26) + "b"


def test_max_tokens_length():
    c, ups = run(SamplingParams(max_tokens=4), ids("abcdefg"))
    assert len(ups) == 4 and ups[-1].reason == "length"
    assert c.text == "abcd"


def test_eos_on_last_allowed_token_is_stop():
    _, ups = run(SamplingParams(max_tokens=2), [0, EOS])
    assert ups[-1].reason == "stop"


def test_stop_string_within_one_token():
    c, ups = run(SamplingParams(max_tokens=10, stop=("d",)), ids("ab") + [27, 0])
    assert ups[-1] == StopUpdate(True, "stop", "c", "d")
    assert c.text == "abc"


def test_stop_string_across_tokens():
    c, ups = run(SamplingParams(max_tokens=20, stop=("bcd",)), [0, 26] + ids("cdef"))
    assert c.text == "aa" and ups[-1].stop_reason == "bcd" and ups[-1].reason == "stop"
    assert c.num_tokens == 4


def test_partial_match_held_back_then_released():
    c, ups = run(SamplingParams(max_tokens=20, stop=("\n\n#",)), ids("ok") + [29] + ids("x"))
    assert [u.text_delta for u in ups] == ["o", "k", "", "\n\nx"]
    assert c.held_text == "" and not c.finished and c.text == "ok\n\nx"


def test_partial_match_released_at_length():
    c, ups = run(SamplingParams(max_tokens=3, stop=("cde",)), ids("abc"))
    assert [u.text_delta for u in ups] == ["a", "b", "c"]
    assert ups[1].text_delta == "b" and ups[-1].reason == "length"
    c2, ups2 = run(SamplingParams(max_tokens=3, stop=("cde",)), ids("acd"))
    assert [u.text_delta for u in ups2] == ["a", "", "cd"] and c2.text == "acd"


def test_partial_match_released_on_eos():
    c, ups = run(SamplingParams(max_tokens=9, stop=("abc",)), ids("zab") + [EOS])
    assert [u.text_delta for u in ups] == ["z", "", "", "ab"]
    assert ups[-1].stop_reason == EOS and c.text == "zab"


def test_stop_string_at_very_start():
    c, ups = run(SamplingParams(max_tokens=9, stop=("ab",)), [26, 2])
    assert ups[0] == StopUpdate(True, "stop", "", "ab")
    assert c.text == "" and c.num_tokens == 1


def test_several_stop_strings_first_completed_wins():
    params = SamplingParams(max_tokens=20, stop=("xyz", "cd", "zz"))
    c, ups = run(params, ids("ab") + [27])  # "abcde": "cd" completes first
    assert ups[-1].stop_reason == "cd" and c.text == "ab"
    c, ups = run(params, ids("qx") + ids("yz"))
    assert ups[-1].stop_reason == "xyz" and c.text == "q"
    # earliest completion wins even if another stop string starts earlier
    c, ups = run(SamplingParams(max_tokens=9, stop=("abcd", "bc")), [26, 2, 3])
    assert ups[-1].stop_reason == "bc" and c.text == "a"


def test_overlapping_prefix_held_correctly():
    c, _ = run(SamplingParams(max_tokens=20, stop=("aab",)), ids("aaab"))
    assert c.text == "a" and c.finished


def test_empty_pieces_do_not_break_holding():
    c, ups = run(SamplingParams(max_tokens=20, stop=("ab",)), [0, 28, 1])
    assert [u.text_delta for u in ups] == ["", "", ""] and ups[-1].stop_reason == "ab"


@pytest.mark.parametrize("stop", [(), ("q",), ("de", "xyzz"), ("\n\n", "cdeab")])
def test_streaming_deltas_concatenate_to_final_text(stop):
    tokens = [26, 27, 29, 30, 30, 0, 1, 27, 26, 2, 3, 4, 29, 30] * 2
    c, ups = run(SamplingParams(max_tokens=len(tokens), stop=stop), tokens)
    assert c.finished
    full = "".join(MULTI.get(t, chr(ord("a") + t)) for t in tokens)
    if ups[-1].reason == "length":
        assert c.text == full and not any(s in full for s in stop)
    else:
        assert full.startswith(c.text) and full[len(c.text):].startswith(ups[-1].stop_reason)
        assert not any(s in c.text for s in stop)


def test_update_after_finish_raises():
    c, _ = run(SamplingParams(max_tokens=1), [0])
    with pytest.raises(RuntimeError, match="finished"):
        c.update(1)
