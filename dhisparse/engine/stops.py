"""Per-request stop detection and stream-safe text release.

A `StopChecker` sees each generated token once (`update`) and decides whether the request is
finished and which text a streaming client may now receive. Rules (OpenAI / vLLM behaviour):

* EOS (unless `ignore_eos`) and `stop_token_ids` finish with reason "stop"; their text is never
  emitted and `stop_reason` is the token id.
* A stop string anywhere in the generated text (also across token boundaries) finishes with
  reason "stop"; the emitted text ends right before it and `stop_reason` is the string. When
  several could match, the one completed first in the text wins (ties: the earliest start), so
  the result does not depend on how the text was split into tokens.
* Otherwise, after `max_tokens` tokens the request finishes with reason "length".

While the tail of the text could still grow into a stop string (a suffix of it is a prefix of a
stop string) that tail is held back and released once it can no longer match, or when the
request finishes for a reason other than a stop string.

    emitted text (final)      | held back (maybe a stop-string prefix)
    "The answer is 4" ........| "\\n\\n"  <- released if the next text is not "#"  (stop="\\n\\n#")
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from dhisparse.core.params import SamplingParams


class Detokenizer(Protocol):
    """Incremental detokenizer: `add` one token id, get back the newly completed text."""

    def add(self, token_id: int) -> str: ...


class FeedDetokenizer:
    """Adapts the tokenizer's incremental detokenizer (its `feed`) to the `Detokenizer` protocol."""

    def __init__(self, inner) -> None:
        self.add = inner.feed


class StopUpdate(NamedTuple):
    """Result of feeding one token.

    finished     True when the request must stop after this token
    reason       "stop" | "length" | None
    text_delta   text now safe to send to a streaming client
    stop_reason  matched stop string, or stop token / EOS id, or None
    """

    finished: bool
    reason: str | None
    text_delta: str
    stop_reason: str | int | None


def _held_suffix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start index, stop string) of the stop string completed earliest in `text`, or None."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        start = text.find(s)
        if start < 0:
            continue
        key = (start + len(s), start, s)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[1], best[2])


class StopChecker:
    """Tracks one request's generated tokens and text against its stop conditions."""

    def __init__(
        self, params: SamplingParams, eos_token_ids: tuple[int, ...], detok: Detokenizer
    ) -> None:
        self.params = params
        self.detok = detok
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = params.stop
        self._emitted: list[str] = []
        self._held = ""
        self._num_tokens = 0
        self._finished: StopUpdate | None = None

    @property
    def text(self) -> str:
        """All text emitted so far (concatenation of every `text_delta`)."""
        return "".join(self._emitted)

    @property
    def pieces(self) -> list[str]:
        """The emitted text pieces (the list only grows; read-only for callers)."""
        return self._emitted

    @property
    def held_text(self) -> str:
        """Text generated but held back because it may still become a stop string."""
        return self._held

    @property
    def num_tokens(self) -> int:
        """Number of tokens fed to `update` (stop/EOS tokens included)."""
        return self._num_tokens

    @property
    def finished(self) -> bool:
        return self._finished is not None

    def update(self, token_id: int) -> StopUpdate:
        """Feed the next generated token; returns whether to stop and the text to stream."""
        if self._finished is not None:
            raise RuntimeError(
                f"StopChecker.update called after the request finished ({self._finished.reason}); "
                "stop feeding tokens once update() returns finished=True"
            )
        token_id = int(token_id)
        self._num_tokens += 1
        if token_id in self._eos or token_id in self._stop_ids:
            return self._finish("stop", self._release_held(), token_id)
        pending = self._held + self.detok.add(token_id)
        match = _first_stop(pending, self._stops) if self._stops else None
        if match is not None:
            start, stop = match
            self._held = ""
            return self._finish("stop", pending[:start], stop)
        hold = _held_suffix_len(pending, self._stops) if self._stops else 0
        delta, self._held = pending[: len(pending) - hold], pending[len(pending) - hold :]
        if self._num_tokens >= self.params.max_tokens:
            return self._finish("length", delta + self._release_held(), None)
        self._emitted.append(delta)
        return StopUpdate(False, None, delta, None)

    def _release_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def _finish(self, reason: str, delta: str, stop_reason: str | int | None) -> StopUpdate:
        self._emitted.append(delta)
        self._finished = StopUpdate(True, reason, delta, stop_reason)
        return self._finished
