"""Turn last-position logits into next tokens, one `SamplingParams` per row.

`processed_probs` is the single definition of "the distribution request i samples from":
the logit processors (penalties, logit_bias, min_tokens: core/logits.py, given the row's
`History`), then temperature, then top-k, then top-p, renormalised; greedy rows are a one-hot at
the argmax of the processed logits.
`Sampler.sample` draws exactly from it, and speculative rejection sampling reuses it for the
target and draft distributions, so the two can never drift apart.

Each sampled row draws with its own `torch.Generator`, row by row, so a seeded request produces
the same tokens whatever else shares its batch.

Ties: candidates are ordered by a stable descending sort, so among equal logits the lowest token
id ranks first (the same tie-break as `torch.argmax`); top-k / top-p cut at a rank, never by value.
"""

from __future__ import annotations

import secrets
from typing import NamedTuple, Sequence

import torch

from dhisparse.core.logits import History, apply_processors
from dhisparse.core.params import MAX_TEMPERATURE, SamplingParams


class SampleOutput(NamedTuple):
    """tokens [N] int64 chosen ids; probs [N, V] fp32 the processed distributions (None on the
    all-greedy fast path, where nothing was computed); failed: row -> why its draw failed (its
    token is -1): one row's failure never stops the others."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    failed: dict[int, str] = {}


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator on `device`; seed None -> seeded from `secrets` (nondeterministic)."""
    g = torch.Generator(device=device)
    g.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return g


def _check_batch(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if logits.shape[0] != len(params):
        raise ValueError(
            f"params must have one SamplingParams per logits row: {len(params)} params for "
            f"{logits.shape[0]} rows"
        )


def _row_settings(params: Sequence[SamplingParams], vocab: int, device) -> tuple[torch.Tensor, ...]:
    """Per-row temperature [N,1], top-k [N,1] (disabled -> V) and top-p [N,1] tensors."""
    temp = [1.0 if p.greedy else min(p.temperature, MAX_TEMPERATURE) for p in params]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    as_col = lambda xs, dt: torch.tensor(xs, dtype=dt).to(device, non_blocking=True).unsqueeze(1)  # noqa: E731
    return as_col(temp, torch.float32), as_col(top_k, torch.int64), as_col(top_p, torch.float32)


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                    history: Sequence[History | None] | None = None) -> torch.Tensor:
    """The distribution each row samples from.

    logits [N, V] fp32 -> probs [N, V] fp32, each row summing to 1. With `history` (one per row,
    None for a row without processors) the penalties / bias / min_tokens mask are applied first
    (`apply_processors`); everything below reads those processed logits.
    Sampled rows: softmax((logits - max) / T) restricted to the top-k ranks, then to the shortest rank
    prefix whose mass reaches top_p (mass measured after top-k), renormalised.
    Greedy rows (temperature < GREEDY_EPS): one-hot at argmax(logits).
    Numerics: logits are shifted by their row max before the division, so the top logit is 0 and
    every other is <= 0 whatever T (>= GREEDY_EPS, <= MAX_TEMPERATURE) is: no inf - inf, no NaN.
    """
    _check_batch(logits, params)
    n, vocab = logits.shape
    logits = apply_processors(logits, params, history).float()
    temp, top_k, top_p = _row_settings(params, vocab, logits.device)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    sorted_logits, order = torch.sort(shifted / temp, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    sorted_probs = sorted_probs * keep
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows).to(logits.device, non_blocking=True)
        one_hot = torch.zeros(len(greedy_rows), vocab, device=logits.device)
        one_hot.scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs


class Sampler:
    """Stateless: per-request state (the generator) is owned by the caller and passed in."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        history: Sequence[History | None] | None = None,
    ) -> SampleOutput:
        """logits [N, V] fp32 -> SampleOutput(tokens [N] int64, probs [N, V] | None).

        Greedy rows take argmax of the processed logits (lowest id on ties). Other rows draw one
        token from their row of `processed_probs` with `generators[i]` (None -> torch's global RNG).
        `history`: per-row `History` for the logit processors (None: none apply).
        """
        _check_batch(logits, params)
        if len(generators) != len(params):
            raise ValueError(
                f"generators must have one entry per row (None allowed): {len(generators)} for "
                f"{len(params)} rows"
            )
        logits = apply_processors(logits, params, history)
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return SampleOutput(greedy_tokens.to(torch.int64), None)
        probs = processed_probs(logits, params)
        tokens = greedy_tokens.to(torch.int64).clone()
        failed: dict[int, str] = {}
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                try:
                    tokens[i] = self.draw(probs[i], g)
                except (RuntimeError, ValueError) as e:  # e.g. a row with no finite mass
                    tokens[i], failed[i] = -1, f"sampling failed: {type(e).__name__}: {e}"
        return SampleOutput(tokens, probs, failed)

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from probs [V] (sums to 1) with `generator`."""
        return int(torch.multinomial(probs, 1, generator=generator)[0])
