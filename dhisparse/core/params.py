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
    ignore_eos      keep generating past the model's EOS token(s); not with a grammar, which
                    allows EOS only where its document is complete (EOS then ends the request)
    min_tokens      EOS and stop_token_ids are masked (probability 0) until this many tokens
                    have been generated (stop strings still apply); 0 disables it
    presence_penalty   OpenAI: logit -= presence_penalty for every token already in the output
    frequency_penalty  OpenAI: logit -= frequency_penalty * (count of the token in the output)
    repetition_penalty CTRL / HF / vLLM: for a token in the prompt or the output, a positive logit
                    is divided by it and a negative one multiplied; 1.0 disables it
    logit_bias      (token id, bias) pairs added to the logits (OpenAI: -100..100)
    logprobs        None: no logprobs; k >= 0: report each output token's logprob and the k most
                    likely alternatives (dhisparse.core.logits.token_logprobs defines them)
    prompt_logprobs None, or k >= 0: the same for every prompt token (echo)
    grammar         None, or a compiled llguidance grammar (structured output, engine/grammar.py):
                    tokens outside it get probability 0
    skip_special_tokens  the output text leaves special tokens out (vLLM's name); the server turns it
                    off when it reads tool calls, whose markers may be special tokens

    Penalties and the bias act on the raw logits before temperature / top-k / top-p, in
    `processed_probs`, so speculative verification judges drafts against the same distribution.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: str | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalise_sequences()
        self._check_numbers()
        self._check_stops()
        self._check_processors()

    def _check_processors(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        bias = tuple(sorted((t, float(b)) if isinstance(b, (int, float)) and not isinstance(b, bool) else (t, b)
                            for t, b in (bias or ())))
        object.__setattr__(self, "logit_bias", bias)
        for t, b in bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            if not isinstance(b, float) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not (0.0 < r <= 100.0):
            raise ValueError(f"repetition_penalty must be in (0, 100] (1 disables it), got {r!r}")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a compiled grammar string or None, got {type(self.grammar).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20):
                raise ValueError(f"{name} must be None or an int in [0, 20], got {v!r}")

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
    def penalised(self) -> bool:
        """True when the logits are changed before temperature (penalties or a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def top_k_enabled(self) -> bool:
        """True when top_k actually restricts the vocabulary (k >= 1)."""
        return self.top_k > 0
