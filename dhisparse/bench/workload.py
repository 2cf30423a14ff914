"""What a closed-loop run offers: the fixed-input workload and the concurrency over time.

Every request's prompt is one prepared prefix (input_len pseudo-random tokens, prefilled once; each request
imports a private copy of its KV) followed by a short per-request suffix, and asks for at most
output_len tokens (with `ignore_eos`, exactly output_len). A run's concurrency follows `Phases`:
one phase for `bench`, C_low -> C_high -> C_low for `loadstep`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

FILLER = (
    "Sparse attention reads only the rows its indexer selects, so a long history can live in host "
    "memory while a small hot cache on the device serves the rows that the next tokens need. "
    "Optional history fills the pages that no request requires and returns them under load. "
)


@dataclass(frozen=True)
class Workload:
    """input_len: prefix tokens shared by every request; output_len: output cap per request;
    duration_s / num_requests: stop after this long or this many requests (one of them);
    timeout_s: hard bound on a run in request-count mode; temperature 0 = greedy;
    warmup: before the timed window, run one short request per client at the run's highest
    concurrency (first-time costs of a batch shape stay out of the numbers); stagger: client k's
    first request is capped at ceil(output_len * (k + 1) / clients) tokens (`max_tokens_for`), so
    completions and re-admissions are spread over one request lifetime from the start instead of
    arriving as one wave (issue 31 item 4: staggered starts; a 30-s window with 2,048-token outputs
    otherwise completes nothing)."""

    input_len: int = 1024
    output_len: int = 128
    duration_s: float | None = 30.0
    num_requests: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 3600.0
    warmup: bool = True
    stagger: bool = False

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1; got {self.input_len}, {self.output_len}")
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("give exactly one of duration_s (--duration) or num_requests (--num-requests)")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0; got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1; got {self.num_requests}")


    def max_tokens_for(self, client: int, first: bool, clients: int) -> int:
        """Output cap of a request: output_len, or with `stagger` a client's first request's share."""
        if not (self.stagger and first):
            return self.output_len
        return max(1, -(-self.output_len * (client + 1) // max(clients, 1)))


class Phase(NamedTuple):
    """Offered concurrency `concurrency` for `duration_s` seconds (inf: until the request count)."""

    concurrency: int
    duration_s: float
    name: str = ""


@dataclass(frozen=True)
class Phases:
    """Concurrency over time: phases back to back, starting at t = 0."""

    phases: tuple[Phase, ...]

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a run needs at least one phase")
        for p in self.phases:
            if p.concurrency < 1 or not p.duration_s > 0:
                raise ValueError(f"phase {p}: concurrency must be >= 1 and duration > 0")

    @classmethod
    def constant(cls, concurrency: int, duration_s: float | None) -> "Phases":
        return cls((Phase(concurrency, math.inf if duration_s is None else duration_s, f"C{concurrency}"),))

    @property
    def total_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    @property
    def max_concurrency(self) -> int:
        return max(p.concurrency for p in self.phases)

    def bounds(self) -> list[tuple[float, float]]:
        """[start, end) of each phase in seconds."""
        out, t = [], 0.0
        for p in self.phases:
            out.append((t, t + p.duration_s))
            t += p.duration_s
        return out

    def index_at(self, t: float) -> int:
        for i, (_, end) in enumerate(self.bounds()):
            if t < end:
                return i
        return len(self.phases) - 1

    def target(self, t: float) -> int:
        """Offered concurrency at time t (the last phase's after the end)."""
        return self.phases[self.index_at(t)].concurrency


def prefix_ids(tokenizer, input_len: int, vocab_size: int | None = None, seed: int = 0) -> list[int]:
    """`input_len` deterministic pseudo-random token ids, as SGLang's and vLLM's `random` datasets:
    uniform over the tokenizer's regular ids below `vocab_size` (the model's), special ids left
    out. Not repeated filler text: a periodic prompt gives many identical keys, and an indexer then
    breaks near-ties differently at every step (no selection locality at all)."""
    lo = getattr(tokenizer, "OFFSET", 0)
    hi = min(tokenizer.vocab_size, vocab_size or tokenizer.vocab_size)
    special = {*getattr(tokenizer, "eos_token_ids", ()), getattr(tokenizer, "bos_token_id", None),
               getattr(tokenizer, "pad_token_id", None)}
    if hi - lo <= len(special):
        raise ValueError(f"the tokenizer has no regular ids below {hi}; cannot build a prefix")
    rng, ids = random.Random(seed), []
    while len(ids) < input_len:
        t = rng.randrange(lo, hi)
        if t not in special:
            ids.append(t)
    return ids


def suffix_text(index: int) -> str:
    """The short per-request tail appended to the prefix."""
    return f"\nQ{index}:"


def filler_words(n: int) -> str:
    """About n words of filler (HTTP fallback when the server has no /tokenize)."""
    words = FILLER.split()
    return " ".join(words[i % len(words)] for i in range(n))
