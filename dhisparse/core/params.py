"""Per-request sampling parameters (the subset of the OpenAI / vLLM knobs the engine honours).

`SamplingParams` is frozen and validated on construction, so the sampler and the stop checker
can trust every field. Lists given for `stop` / `stop_token_ids` are normalised to tuples, and a
single string for `stop` becomes a 1-tuple, so params stay hashable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_EPS = 1e-5
"""Temperatures below this sample greedily (vLLM's rule): 1/T would overflow fp32 logits long
before T reaches the smallest positive double, and the limit T -> 0 is the argmax anyway."""

MAX_TEMPERATURE = 3.0e38
"""Temperatures are clamped to this (the largest finite fp32 is 3.4e38) before dividing logits."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    max_tokens      number of generated tokens after which the request finishes ("length")
    temperature     0 means greedy (argmax); > 0 scales logits by 1/temperature; any finite
                    value below GREEDY_EPS (1e-5) is greedy too
    top_k           keep the k most likely tokens; 0 or -1 disables it
    top_p           nucleus sampling: keep the smallest prefix of mass >= top_p; 1.0 disables it
    seed            per-request RNG seed; None draws a fresh nondeterministic seed
    stop            strings that end generation; the emitted text stops right before them
    stop_token_ids  token ids that end generation (their text is not emitted)
    ignore_eos      keep generating past the model's EOS token(s)
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self._normalise_sequences()
        self._check_numbers()
        self._check_stops()

    def _normalise_sequences(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    def _check_numbers(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int (0 or -1 disables it), got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an int >= 0 or None, got {self.seed!r}")
            if self.seed < 0:
                raise ValueError(f"seed must be >= 0 or None, got {self.seed}")

    def _check_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty str, got {s!r} in stop={self.stop!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be ints >= 0, got {t!r} in stop_token_ids={self.stop_token_ids!r}"
                )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature < GREEDY_EPS, 0 included)."""
        return self.temperature < GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        """True when top_k actually restricts the vocabulary (k >= 1)."""
        return self.top_k > 0
