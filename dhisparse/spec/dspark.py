"""DSpark-style confidence scheduling: a verification width K_r per request and round.

The drafter reports, per drafted token i, a confidence c_i ~ P(x_i accepted | x_1..x_{i-1}
accepted). Verifying K drafts-plus-anchor then emits in expectation

    E(K) = 1 + sum_{i=1}^{K-1} prod_{j<=i} c_j            (accepted drafts + the bonus)

and costs cost(K) seconds per round (`VerifyCost`, measured at start-up or online). We pick
K_r = argmax_{1 <= K <= min(K_max, drafts + 1)} E(K) / cost(K) (ties -> the narrower K):
confident drafts earn a wide block, unconfident ones a narrow one, and K_r = 1 (no drafts) is a
plain decode step. The proposals and the acceptance rule are unchanged; only the prefix sent to
the target is chosen.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from dhisparse.spec.drafter import DrafterBytes, DraftProposal, DraftRequest, Drafter, Features


def expected_emitted(confidences: Sequence[float], width: int) -> float:
    """E(K) for K = width: 1 + sum over the first width-1 cumulative products of confidences."""
    total, survive = 1.0, 1.0
    for c in list(confidences)[: max(0, width - 1)]:
        survive *= min(max(float(c), 0.0), 1.0)
        total += survive
    return total


class VerifyCost:
    """Seconds per verification round as a function of the width (queries per request).

    `update(width, seconds)` folds a measurement in with an EMA (weight `alpha` for the new
    value), first capped at `clip` x the current estimate (once anything is measured): one step
    that compiled a kernel or captured a graph (seconds, against milliseconds) then moves the
    estimate by at most alpha x (clip - 1), where uncapped it made that width look unusable until
    it was measured again, which a policy that stopped choosing it never did. `cost(width)`
    returns the measured value, interpolates linearly between measured widths and extrapolates
    from the nearest two; with one measurement it scales it by the shape of `prior`, with none it
    returns `prior(width)` (default 1 + 0.1 (K - 1)).
    """

    def __init__(self, measured: dict[int, float] | None = None, alpha: float = 0.2,
                 prior: Callable[[float], float] | None = None, clip: float = 2.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"VerifyCost.alpha must be in (0, 1], got {alpha}")
        if not clip > 1.0:
            raise ValueError(f"VerifyCost.clip must be > 1, got {clip}")
        self.alpha, self.clip = alpha, clip
        self.prior = prior or (lambda w: 1.0 + 0.1 * (w - 1))
        self._table: dict[int, float] = {}
        for w, s in (measured or {}).items():
            self._set(w, s)

    @classmethod
    def linear(cls, base: float, per_query: float) -> "VerifyCost":
        """cost(K) = base + per_query * (K - 1), as a prior with no measurements."""
        return cls(prior=lambda w: base + per_query * (w - 1))

    @classmethod
    def measure(cls, run: Callable[[int], None], widths: Iterable[int], repeats: int = 3) -> "VerifyCost":
        """Start-up profile: time `run(width)` (one verification round at that width) per width."""
        table = {}
        for w in widths:
            run(w)  # warm-up
            t0 = time.perf_counter()
            for _ in range(repeats):
                run(w)
            table[w] = max((time.perf_counter() - t0) / repeats, 1e-9)
        return cls(table)

    def _set(self, width: int, seconds: float) -> None:
        if width < 1 or not seconds > 0:
            raise ValueError(f"VerifyCost: need width >= 1 and seconds > 0, got width={width}, seconds={seconds}")
        self._table[int(width)] = float(seconds)

    def update(self, width: int, seconds: float) -> None:
        if self._table and seconds > 0:
            seconds = min(seconds, self.clip * self.cost(width))
        old = self._table.get(int(width))
        self._set(width, seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds)

    @property
    def measured(self) -> dict[int, float]:
        return dict(sorted(self._table.items()))

    def cost(self, width: float) -> float:
        pts = sorted(self._table.items())
        if not pts:
            return float(self.prior(width))
        if len(pts) == 1:
            w0, s0 = pts[0]
            return s0 * float(self.prior(width)) / float(self.prior(w0))
        for (w0, s0), (w1, s1) in zip(pts, pts[1:]):
            if w0 <= width <= w1:
                return s0 + (s1 - s0) * (width - w0) / (w1 - w0)
        (w0, s0), (w1, s1) = (pts[0], pts[1]) if width < pts[0][0] else (pts[-2], pts[-1])
        return max(s0 + (s1 - s0) * (width - w0) / (w1 - w0), 1e-12)


def choose_width(confidences: Sequence[float], cost: VerifyCost, k_max: int) -> int:
    """K_r in [1, min(k_max, len(confidences) + 1)] maximising E(K) / cost(K)."""
    if k_max < 1:
        raise ValueError(f"choose_width: k_max must be >= 1, got {k_max}")
    best, best_rate = 1, expected_emitted(confidences, 1) / cost.cost(1)
    for k in range(2, min(k_max, len(confidences) + 1) + 1):
        rate = expected_emitted(confidences, k) / cost.cost(k)
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = k, rate
    return best


class DSparkDrafter:
    """Wraps a drafter (typically `DFlashDrafter`): drafts with the full allowed width, then cuts
    each proposal to the width `choose_width` picks. Everything else is delegated."""

    def __init__(self, inner: Drafter, cost: VerifyCost) -> None:
        self.inner, self.cost = inner, cost
        self.last_widths: list[int] = []

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.inner.capture_layers

    @property
    def feature_window(self) -> int:
        return self.inner.feature_window

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        proposals = self.inner.propose(requests)
        widths = [choose_width(p.confidences, self.cost, r.max_width) for r, p in zip(requests, proposals)]
        self.last_widths = widths
        return [p.truncated(w - 1) for p, w in zip(proposals, widths)]

    def admit(self, request_id: str) -> None:
        self.inner.admit(request_id)

    def observe(self, request_id: str, features: Features, start: int) -> None:
        self.inner.observe(request_id, features, start)

    def commit(self, request_id: str, accepted: int, new_features: Features | None = None) -> None:
        self.inner.commit(request_id, accepted, new_features)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def state_bytes_per_request(self) -> int:
        return self.inner.state_bytes_per_request()

    def device_bytes(self) -> DrafterBytes:
        return self.inner.device_bytes()
