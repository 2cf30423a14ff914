"""Verification-width policy: a static schedule by load and an online policy (eq. 13).

Static (the paper's GLM runs): width 8 up to C32, 6 at C64, 4 from C128 — configurable as
((max concurrency, width), ...) plus the width above every bound.

Online (the paper leaves it as future work): with b active sessions output is ~ b / TPOT, so
speculation at width K against no speculation (K = 1) returns

    Q_K / Q_0 ~ (b_K / b_0) * (TPOT_0 / TPOT_K)                                       (eq. 13)

where TPOT_K = cost(K) / E(K) (round cost over tokens per round, from the measured per-position
acceptance EMA), and b_K = min(concurrency, sessions that fit in memory with speculation's
extra per-session and fixed state). The policy picks the K with the largest ratio and turns
speculation off (K = 1) when no K beats 1 + margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from dhisparse.spec.dspark import VerifyCost, expected_emitted


@dataclass(frozen=True)
class StaticWidthSchedule:
    """width(C) = the width of the first (bound, width) with C <= bound, else `default`."""

    steps: tuple[tuple[int, int], ...] = ((32, 8), (127, 6))
    default: int = 4

    def width(self, concurrency: int, k_max: int | None = None) -> int:
        w = next((w for bound, w in self.steps if concurrency <= bound), self.default)
        return min(w, k_max) if k_max is not None else w


def output_ratio(b_s: float, b_0: float, tpot_s: float, tpot_0: float) -> float:
    """Eq. 13: Q_s / Q_0 = (b_s / b_0) * (TPOT_0 / TPOT_s)."""
    if b_0 <= 0 or tpot_s <= 0:
        raise ValueError(f"output_ratio needs b_0 > 0 and tpot_s > 0, got b_0={b_0}, tpot_s={tpot_s}")
    return (b_s / b_0) * (tpot_0 / tpot_s)


def speculation_pays(b_s: float, b_0: float, tpot_s: float, tpot_0: float, margin: float = 0.0) -> bool:
    """True while the share of sessions speculation keeps exceeds its TPOT ratio (by `margin`)."""
    return output_ratio(b_s, b_0, tpot_s, tpot_0) > 1.0 + margin


@dataclass(frozen=True)
class MemoryModel:
    """Sessions that fit: capacity_bytes for request state; session_bytes required per session
    without speculation; spec_session_bytes added per session with it (draft ring + staging
    share); spec_fixed_bytes speculation's fixed cost (drafter weights, workspaces)."""

    capacity_bytes: int
    session_bytes: int
    spec_session_bytes: int = 0
    spec_fixed_bytes: int = 0

    def sessions(self, concurrency: int, speculative: bool, capacity_bytes: int | None = None) -> int:
        cap = self.capacity_bytes if capacity_bytes is None else capacity_bytes
        if speculative:
            fit = max(0, cap - self.spec_fixed_bytes) // (self.session_bytes + self.spec_session_bytes)
        else:
            fit = cap // self.session_bytes
        return int(min(concurrency, fit))


class WidthDecision(NamedTuple):
    """width 1 means speculation off. ratio: eq. 13 estimate of Q_width / Q_0. probe: a round run
    against the decision to keep its inputs measured (`OnlineWidthPolicy.probe_every`)."""

    width: int
    tokens_per_round: float
    ratio: float
    sessions: int
    sessions_without: int
    probe: bool = False

    @property
    def speculate(self) -> bool:
        return self.width > 1


class OnlineWidthPolicy:
    """Chooses the width from measured acceptance (EMA per draft position), step cost per width
    (`VerifyCost`, width 1 = a non-speculative step) and memory (`MemoryModel`).

    Acceptance at position i is the conditional rate P(x_i accepted | x_1..x_{i-1} accepted)
    (`acceptance`, an EMA from `prior`). A position never judged is estimated by the nearest
    judged one before it (`estimates`): a round at width w judges only positions < w, so with
    the prior there a policy that once chose a narrow width would price every wider one at the
    prior for good (on the H200, 0.5 against a measured 0.79, and width 2 chosen over 8).

    Probes keep both sides of eq. 13 measured: after `probe_every` decisions in a row with
    speculation off, one round runs at the best speculative width (its acceptance and cost are
    observed, so a drafter that became useful turns speculation back on); after `probe_every` in
    a row with it on, one step runs at width 1 (TPOT_0, `cost(1)`, is measured, not a prior), and
    every other such probe instead at the widest width when that is not already the choice (its
    positions' acceptance and its cost stay measured). 0 disables probes.

    Start-up: the prior counts as `prior_weight` observations, so a position's first judgements
    move its estimate as a running mean would (weight 1 / (judged + prior_weight + 1), never below
    `ema`), and until position 1 has been judged `warmup` times every decision is the widest
    width (a probe: it judges every position). Without both, a prior below the drafter's true
    acceptance priced speculation out from the first round, and probes every `probe_every`
    rounds moving an EMA by `ema` took seconds to price it back in (on the H200 in session 22,
    ~1.04 tokens a round for the first 4-5 s of a 10-s window at C2, where width 8 gives 4.0).
    """

    def __init__(self, k_max: int, cost: VerifyCost, memory: MemoryModel | None = None,
                 widths: Sequence[int] | None = None, ema: float = 0.05, prior: float = 0.6,
                 margin: float = 0.0, probe_every: int = 32, prior_weight: float = 4.0, warmup: int = 32) -> None:
        if k_max < 2:
            raise ValueError(f"OnlineWidthPolicy.k_max must be >= 2, got {k_max}")
        self.k_max, self.cost, self.memory = k_max, cost, memory
        self.widths = sorted(set(widths or range(2, k_max + 1)))
        if self.widths[0] < 2 or self.widths[-1] > k_max:
            raise ValueError(f"OnlineWidthPolicy.widths must lie in [2, k_max={k_max}], got {self.widths}")
        if probe_every < 0:
            raise ValueError(f"OnlineWidthPolicy.probe_every must be >= 0 (0: no probes), got {probe_every}")
        if prior_weight < 0 or warmup < 0:
            raise ValueError(f"OnlineWidthPolicy: prior_weight and warmup must be >= 0, got {prior_weight}, {warmup}")
        self.ema, self.margin, self.probe_every = ema, margin, probe_every
        self.prior, self.prior_weight, self.warmup = prior, prior_weight, warmup
        self.reset()

    def reset(self) -> None:
        """Forget what was observed: acceptance back to the prior, start-up measuring again (the
        cost table is `cost`'s own, `VerifyCost.clear`). For an engine's warm-up, whose synthetic
        requests the drafter cannot predict and whose steps compile."""
        self.acceptance = [self.prior] * (self.k_max - 1)  # index i-1 for draft position i
        self.judged = [0] * (self.k_max - 1)  # rounds that judged position i
        self._streak = (1, 0)  # (width class of the last decisions: 1 off / 2 on, how many in a row)
        self._on_probes = 0  # probes taken while speculating (even: width 1, odd: the widest width)

    def observe(self, width: int, accepted: int) -> None:
        """One verified round: drafts 1..accepted accepted, draft accepted+1 (if any) rejected."""
        if not 0 <= accepted <= width - 1 <= self.k_max - 1:
            raise ValueError(f"observe: need 0 <= accepted <= width-1 <= k_max-1, got width={width}, accepted={accepted}")
        for i in range(min(accepted + 1, width - 1)):
            hit = 1.0 if i < accepted else 0.0
            weight = max(self.ema, 1.0 / (self.judged[i] + self.prior_weight + 1))
            self.acceptance[i] += weight * (hit - self.acceptance[i])
            self.judged[i] += 1

    def estimates(self) -> list[float]:
        """Per-position acceptance for pricing widths: `acceptance`, where a position never judged
        takes the estimate of the position before it (the first keeps the prior)."""
        out = []
        for i, a in enumerate(self.acceptance):
            out.append(a if self.judged[i] or i == 0 else out[-1])
        return out

    def observe_cost(self, width: int, seconds: float) -> None:
        self.cost.update(width, seconds)

    def tokens_per_round(self, width: int) -> float:
        return expected_emitted(self.estimates(), width)

    def decide(self, concurrency: int, capacity_bytes: int | None = None) -> WidthDecision:
        """Width of the next round for `concurrency` offered sessions (and, optionally, the live
        capacity): the eq. 13 best, or a probe of the other side (class docstring)."""
        if self.judged[0] < self.warmup:  # start-up: measure acceptance at every position first
            return self._decision(self.widths[-1], concurrency, capacity_bytes)._replace(probe=True)
        best, top = self.best(concurrency, capacity_bytes)
        kind = 2 if best.speculate else 1
        n = self._streak[1] + 1 if self._streak[0] == kind else 1
        if self.probe_every and n > self.probe_every:
            self._streak = (kind, 0)
            return self._probe(kind, best, top, concurrency, capacity_bytes)._replace(probe=True)
        self._streak = (kind, n)
        return best

    def _probe(self, kind: int, best: WidthDecision, top: WidthDecision, concurrency: int,
               capacity_bytes: int | None) -> WidthDecision:
        """Off: the best speculative width. On: width 1, or every other time the widest width."""
        if kind == 1:
            return top
        self._on_probes += 1
        widest = self.widths[-1]
        if self._on_probes % 2 == 0 and best.width != widest:
            return self._decision(widest, concurrency, capacity_bytes)
        return WidthDecision(1, 1.0, 1.0, best.sessions_without, best.sessions_without)

    def _decision(self, w: int, concurrency: int, capacity_bytes: int | None) -> WidthDecision:
        """Eq. 13's estimate for speculating at width w."""
        b0 = self._sessions(concurrency, False, capacity_bytes)
        bs = self._sessions(concurrency, True, capacity_bytes)
        e = self.tokens_per_round(w)
        ratio = output_ratio(bs, b0, self.cost.cost(w) / e, self.cost.cost(1)) if b0 > 0 else 0.0
        return WidthDecision(w, e, ratio, bs, b0)

    def best(self, concurrency: int, capacity_bytes: int | None = None) -> tuple[WidthDecision, WidthDecision]:
        """(the eq. 13 decision, the best speculative width even when it does not pay)."""
        b0 = self._sessions(concurrency, False, capacity_bytes)
        best = top = WidthDecision(1, 1.0, 1.0, b0, b0)
        for w in self.widths:
            d = self._decision(w, concurrency, capacity_bytes)
            if top.width == 1 or d.ratio > top.ratio:
                top = d
            if d.ratio > max(best.ratio, 1.0 + self.margin):
                best = d
        return best, top

    def _sessions(self, concurrency: int, speculative: bool, capacity_bytes: int | None) -> int:
        if self.memory is None:
            return max(concurrency, 1)
        return self.memory.sessions(concurrency, speculative, capacity_bytes)
