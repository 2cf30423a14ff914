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

import statistics
import time
from collections import deque
from typing import Callable, Iterable, Sequence

from dhisparse.spec.drafter import Commit, DrafterBytes, DraftProposal, DraftRequest, Drafter, Features


def expected_emitted(confidences: Sequence[float], width: int) -> float:
    """E(K) for K = width: 1 + sum over the first width-1 cumulative products of confidences."""
    total, survive = 1.0, 1.0
    for c in list(confidences)[: max(0, width - 1)]:
        survive *= min(max(float(c), 0.0), 1.0)
        total += survive
    return total


class VerifyCost:
    """Seconds per verification round as a function of the width (queries per request).

    `update(width, seconds)` adds a sample to that width's window of its last `window` samples; a
    width's cost is its window's median, so one step that compiled a kernel or captured a graph
    (seconds, against milliseconds) moves nothing once the window holds three samples. A width's
    first sample is capped at `clip` x the estimate its measured neighbours give (once anything
    is measured); later ones are not: a cap against the width's own estimate would also hold a
    too-low first sample down, each real sample capped at 2x it. (Session 23 on the H200: an EMA
    with that cap, fed a first sample that compiled, priced width 8 at twice its cost for seconds
    after the online policy's warm-up, and a near-zero width-1 sample took seconds to
    climb back.) `clear()` forgets every sample (the constructor's `measured` table stays).
    `cost(width)` returns the measured value, interpolates linearly between measured widths and
    extrapolates from the nearest two; with one measurement it scales it by the shape of `prior`,
    with none it returns `prior(width)` (default 1 + 0.1 (K - 1)).
    """

    def __init__(self, measured: dict[int, float] | None = None, window: int = 9,
                 prior: Callable[[float], float] | None = None, clip: float = 2.0) -> None:
        if window < 1:
            raise ValueError(f"VerifyCost.window must be >= 1, got {window}")
        if not clip > 1.0:
            raise ValueError(f"VerifyCost.clip must be > 1, got {clip}")
        self.window, self.clip = window, clip
        self.prior = prior or (lambda w: 1.0 + 0.1 * (w - 1))
        self._initial = dict(measured or {})
        self.clear()

    def clear(self) -> None:
        """Forget every measured sample: back to the constructor's `measured` table."""
        self._samples: dict[int, deque[float]] = {}
        self._table: dict[int, float] = {}
        for w, s in self._initial.items():
            self._add(w, s)

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

    def _add(self, width: int, seconds: float) -> None:
        if width < 1 or not seconds > 0:
            raise ValueError(f"VerifyCost: need width >= 1 and seconds > 0, got width={width}, seconds={seconds}")
        window = self._samples.setdefault(int(width), deque(maxlen=self.window))
        window.append(float(seconds))
        self._table[int(width)] = statistics.median(window)

    def update(self, width: int, seconds: float) -> None:
        if self._table and seconds > 0 and int(width) not in self._samples:
            seconds = min(seconds, self.clip * self.cost(width))
        self._add(width, seconds)

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

    def commit_many(self, items: Sequence[Commit]) -> list[Exception | None]:
        return self.inner.commit_many(items)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def use_graphs(self, runner, max_requests: int) -> bool:
        return self.inner.use_graphs(runner, max_requests)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def state_bytes_per_request(self) -> int:
        return self.inner.state_bytes_per_request()

    def device_bytes(self) -> DrafterBytes:
        return self.inner.device_bytes()
