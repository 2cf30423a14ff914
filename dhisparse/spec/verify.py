"""Acceptance and commit (paper eq. 7-8; invariants I5, I7).

Request r verifies K_r tokens [x_0 (anchor), x_1..x_{K_r-1} (drafts)] at positions n..n+K_r-1 in
one target pass; target row i predicts the token at position n+i+1, so draft x_{i+1} is judged
against row i. The verifier accepts A_r drafts (0 <= A_r <= K_r-1) and emits a correction or
bonus b_r from row A_r:

    new output = [x_1..x_A, b],   committed prefix = [x_0..x_A],   n' = n + 1 + A        (eq. 7)

Greedy: A = longest prefix with x_{i+1} == argmax(row i) (lowest id on ties, like the Sampler);
b = argmax(row A). The output is token-identical to non-speculative greedy decoding.

Sampling (Leviathan et al., 2023): p_i = processed_probs(row i, params) (exactly what the request
samples from without speculation), q_i the draft distribution (point mass on x_{i+1} when the
drafter gives none). Accept x_{i+1} with probability min(1, p_i(x)/q_i(x)); at the first rejection
draw b from norm(max(0, p_i - q_i)); if every draft is accepted draw b from p at row K_r-1.
Each emitted token is then distributed exactly as under p. Draws use the request's generator.

Logit processors (penalties, logit_bias, min_tokens; core/logits.py): with a request's `History`
(its output before the anchor's successor), row i is processed with output + x_1..x_i, which is
what non-speculative decoding sees at that position; greedy rows then compare against the argmax
of the processed row and sampled rows use processed_probs of it. The engine applies the same
`apply_processors` to its verification logits before calling `verify_batch` (without history).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from dhisparse.core.logits import History, apply_processors
from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import processed_probs


class Acceptance(NamedTuple):
    """One request's verification result.

    accepted   A_r: drafts accepted (0 <= A <= K_r - 1)
    emitted    [x_1..x_A, b]: A + 1 new output tokens (b = correction / bonus, the next anchor)
    committed  1 + A: positions n..n+A whose target rows become committed (n' = n + committed)
    """

    accepted: int
    emitted: list[int]
    committed: int

    @property
    def bonus(self) -> int:
        return self.emitted[-1]


def _result(drafts: Sequence[int], accepted: int, bonus: int) -> Acceptance:
    return Acceptance(accepted, [int(t) for t in drafts[:accepted]] + [int(bonus)], 1 + accepted)


def _check_rows(rows: torch.Tensor | int, drafts: Sequence[int], what: str) -> None:
    """rows: the [K_r, V] tensor, or just its row count (verify_batch: no tensor slice per request)."""
    shape = (rows,) if isinstance(rows, int) else tuple(rows.shape)
    two_d = isinstance(rows, int) or len(shape) == 2
    if not two_d or shape[0] != len(drafts) + 1:
        raise ValueError(
            f"{what} must be [K_r, V] with K_r = len(drafts) + 1 = {len(drafts) + 1} rows "
            f"(anchor + drafts), got {shape}"
        )


def verify_greedy(target_logits: torch.Tensor, drafts: Sequence[int]) -> Acceptance:
    """target_logits [K_r, V]; drafts x_1..x_{K_r-1} -> Acceptance (longest matching prefix)."""
    _check_rows(target_logits, drafts, "target_logits")
    return greedy_acceptance(target_logits.argmax(dim=-1).tolist(), drafts)


def greedy_acceptance(best: Sequence[int], drafts: Sequence[int]) -> Acceptance:
    """best: the target's token per row (anchor first; len(drafts) + 1 of them) -> the longest prefix of
    drafts equal to it, and the next of best as the bonus (greedy verification; also the reference
    replay's, engine/replay.py)."""
    accepted = 0
    while accepted < len(drafts) and int(drafts[accepted]) == best[accepted]:
        accepted += 1
    return _result(drafts, accepted, best[accepted])


def verify_sampled(
    target_probs: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Acceptance:
    """Rejection sampling. target_probs [K_r, V] (rows sum to 1); draft_probs [K_r-1, V] or None
    (point masses on the drafts). Consumes one uniform per judged draft and one draw for b."""
    _check_rows(target_probs, drafts, "target_probs")
    if draft_probs is not None and tuple(draft_probs.shape) != (len(drafts), target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [{len(drafts)}, {target_probs.shape[1]}] (one row per draft), "
            f"got {tuple(draft_probs.shape)}"
        )
    p_all = target_probs.float()
    for i, x in enumerate(int(t) for t in drafts):
        p = p_all[i]
        q = _draft_row(draft_probs, i, x, p)
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[x] < p[x]:  # accept with probability min(1, p(x) / q(x))
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else p  # total == 0 only if p == q (measure zero)
        return _result(drafts, i, int(torch.multinomial(residual, 1, generator=generator)))
    bonus = int(torch.multinomial(p_all[len(drafts)], 1, generator=generator))
    return _result(drafts, len(drafts), bonus)


def _draft_row(draft_probs: torch.Tensor | None, i: int, x: int, like: torch.Tensor) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs[i].to(like.dtype)
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q


def verify_request(
    target_logits: torch.Tensor,
    drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: History | None = None,
) -> Acceptance:
    """Dispatch on params: greedy rows compare argmaxes, sampled rows run rejection sampling.
    `history`: the request's History before this round (its processors then apply per row)."""
    target_logits = apply_processors(target_logits, [params] * target_logits.shape[0], row_history(history, drafts))
    if params.greedy:
        return verify_greedy(target_logits, drafts)
    probs = processed_probs(target_logits, [params] * target_logits.shape[0])
    return verify_sampled(probs, drafts, draft_probs, generator)


def row_history(history: History | None, drafts: Sequence[int],
                masks: Sequence[torch.Tensor | None] | None = None) -> list[History | None]:
    """A request's History before a round -> one per verification row (row i: + drafts[:i], with
    the grammar mask masks[i] when given: `Matcher.round_masks`)."""
    if history is None:
        return [None] * (len(drafts) + 1)
    return [history.extended(drafts[:i], None if masks is None else masks[i]) for i in range(len(drafts) + 1)]


def verify_batch(
    logits: torch.Tensor,
    query_start: Sequence[int],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    history: Sequence[History | None] | None = None,
) -> list[Acceptance]:
    """Verify a flattened target pass.

    logits [T, V] fp32 for all verification tokens; request r owns rows
    query_start[r]:query_start[r+1] (= len(drafts[r]) + 1 rows). The processed target
    distributions are computed once for all sampled rows.
    """
    n = len(query_start) - 1
    if not (len(drafts) == len(draft_probs) == len(params) == len(generators) == n):
        raise ValueError(
            f"verify_batch: query_start describes {n} requests but got {len(drafts)} drafts, "
            f"{len(draft_probs)} draft_probs, {len(params)} params, {len(generators)} generators"
        )
    if query_start[0] != 0 or query_start[-1] != logits.shape[0]:
        raise ValueError(
            f"verify_batch: query_start must run from 0 to the number of logits rows {logits.shape[0]}, "
            f"got {query_start[0]}..{query_start[-1]}"
        )
    row_params = [params[r] for r in range(n) for _ in range(query_start[r], query_start[r + 1])]
    if history is not None:
        logits = apply_processors(logits, row_params, [h for r in range(n) for h in row_history(history[r], drafts[r])])
    sampled = any(not p.greedy for p in params)
    probs = processed_probs(logits, row_params) if sampled else None
    best = logits.argmax(dim=-1).tolist() if any(p.greedy for p in params) else None  # one sync for all
    out = []
    for r in range(n):
        a, b = query_start[r], query_start[r + 1]
        if params[r].greedy:
            _check_rows(b - a, drafts[r], f"request {r}'s target_logits")
            out.append(greedy_acceptance(best[a:b], drafts[r]))
        else:
            out.append(verify_sampled(probs[a:b], drafts[r], draft_probs[r], generators[r]))
    return out


def commit_rows(n: int, n_new: int, m: int = 1) -> range:
    """Source rows completed when the frontier moves from n to n + n_new (eq. 8):
    floor(n/m) <= s < floor((n + n_new)/m). m = tokens packed per stored row (1 = uncompressed)."""
    if n < 0 or n_new < 0 or m < 1:
        raise ValueError(f"commit_rows needs n >= 0, n_new >= 0, m >= 1; got n={n}, n_new={n_new}, m={m}")
    return range(n // m, (n + n_new) // m)
