"""The drafter contract: what the engine hands a drafter each round and what it gets back.

A speculative round of request r (paper §3.3, eq. 7) starts from n committed positions
0..n-1 (their target KV exists) and the anchor x_0 at position n (the last emitted token: the
previous round's correction/bonus, or the first token sampled after prefill; it has no target KV
yet). The drafter proposes x_1..x_{K_r-1}; the target runs the K_r tokens [x_0, x_1, ...] at
positions n..n+K_r-1 in one pass; the verifier accepts A of the drafts and emits a bonus b.
Committed prefix = [x_0..x_A], so the drafter is then told `commit(rid, A, features)` with the
target features of those 1 + A positions (invariant I5: it advances with the same prefix).

Target features: the engine runs the target with `capture_layers=drafter.capture_layers` and
passes `{layer: [rows, hidden]}` slices. Prompt features go to `observe(rid, feats, start)` per
prefill chunk (a long prompt may pass only its last W positions: start = n - W), or all at once
in the first `DraftRequest.new_features` (positions right after what the drafter holds); the
features of each round's committed positions go to `commit_many` (every request of the round in
one call; `commit` for one). Drafters that need no features (n-gram, oracle) report
`capture_layers == ()` and ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from dhisparse.core.params import SamplingParams

Features = Mapping[int, torch.Tensor]  # target layer -> [rows, hidden]


class TokenIds(Sequence[int]):
    """Read-only view of the first n ids of prompt_ids + output_ids, without concatenating them.
    Slices come back as lists (C-speed list slices); the lists must not shrink while the view is
    used (a round's drafting reads it right away; output ids only grow)."""

    __slots__ = ("_prompt", "_output", "_n")

    def __init__(self, prompt_ids: list[int], output_ids: list[int], n: int) -> None:
        if not 0 <= n <= len(prompt_ids) + len(output_ids):
            raise ValueError(f"TokenIds: n must be in [0, {len(prompt_ids) + len(output_ids)}], got {n}")
        self._prompt, self._output, self._n = prompt_ids, output_ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        P = len(self._prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            stop = max(start, stop)
            if stop <= P:
                return self._prompt[start:stop]
            if start >= P:
                return self._output[start - P : stop - P]
            return self._prompt[start:] + self._output[: stop - P]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(f"TokenIds index {i} out of range for {self._n} ids")
        return self._prompt[j] if j < P else self._output[j - P]

    def __iter__(self):
        P = len(self._prompt)
        yield from self._prompt[: min(P, self._n)]
        yield from self._output[: max(0, self._n - P)]


@dataclass(frozen=True)
class DraftRequest:
    """One request's input to `Drafter.propose` for one round.

    request_id        engine request id
    token_ids         tokens at positions 0..n-1 (prompt + output so far, all with target KV); any
                      Sequence (a read-only view avoids a copy: drafters only take len() and slices)
    anchor            token at position n: the last verified / emitted token (x_0)
    max_width         K_max allowed this round (target queries incl. the anchor; 1 = no drafts)
    params            the request's sampling params (draft distributions use the same processing)
    num_prompt_tokens how many of token_ids are prompt (the rest is output)
    new_features      features of positions the drafter has not seen yet, {layer: [rows, hidden]}
                      (e.g. the whole prompt after prefill); None when there are none
    """

    request_id: str
    token_ids: Sequence[int]
    anchor: int
    max_width: int
    params: SamplingParams = field(default_factory=SamplingParams)
    num_prompt_tokens: int = 0
    new_features: Features | None = None

    def __post_init__(self) -> None:
        if self.max_width < 1:
            raise ValueError(f"DraftRequest.max_width must be >= 1 (1 = no drafts), got {self.max_width}")
        if not 0 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"DraftRequest.num_prompt_tokens must be in [0, len(token_ids)={len(self.token_ids)}], "
                f"got {self.num_prompt_tokens}"
            )

    @classmethod
    def from_history(cls, request_id: str, all_ids: Sequence[int], max_width: int, **kw) -> "DraftRequest":
        """Build from the engine's full id list (prompt + output); its last id is the anchor."""
        if not all_ids:
            raise ValueError("DraftRequest.from_history: all_ids is empty; a round needs an anchor token")
        return cls(request_id, list(all_ids[:-1]), int(all_ids[-1]), max_width, **kw)

    @classmethod
    def from_parts(cls, request_id: str, prompt_ids: list[int], output_ids: list[int], max_width: int,
                   **kw) -> "DraftRequest":
        """`from_history(prompt_ids + output_ids)` without building that list: token_ids is a
        `TokenIds` view (a round at C36 with 8K histories copied ~0.6M ids per step before)."""
        n = len(prompt_ids) + len(output_ids)
        if n == 0:
            raise ValueError("DraftRequest.from_parts: no ids; a round needs an anchor token")
        anchor = (output_ids or prompt_ids)[-1]
        return cls(request_id, TokenIds(prompt_ids, output_ids, n - 1), anchor, max_width, **kw)

    @property
    def num_committed(self) -> int:
        """n: positions with target KV; the anchor sits at position n."""
        return len(self.token_ids)

    @property
    def max_drafts(self) -> int:
        return self.max_width - 1


@dataclass(frozen=True)
class DraftProposal:
    """A drafter's answer for one request.

    tokens       x_1..x_{K_r-1}: the K_r - 1 drafted tokens after the anchor (may be empty)
    probs        [K_r - 1, V] fp32 draft distributions q the tokens were drawn from, for rejection
                 sampling; None = deterministic drafter (q is a point mass on each token)
    confidences  per drafted token, the drafter's estimate that it is accepted given its
                 predecessors were (DSpark schedules widths from these)
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidences: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.confidences) != len(self.tokens):
            raise ValueError(
                f"DraftProposal: {len(self.confidences)} confidences for {len(self.tokens)} tokens; "
                "give one confidence per drafted token"
            )
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != len(self.tokens)):
            raise ValueError(
                f"DraftProposal.probs must be [{len(self.tokens)}, V] (one row per drafted token), "
                f"got {tuple(self.probs.shape)}"
            )

    @property
    def width(self) -> int:
        """K_r: target queries this proposal needs (anchor + drafts)."""
        return len(self.tokens) + 1

    def truncated(self, num_drafts: int) -> "DraftProposal":
        """The first `num_drafts` drafts (K_r = num_drafts + 1)."""
        k = max(0, min(num_drafts, len(self.tokens)))
        probs = None if self.probs is None else self.probs[:k]
        return DraftProposal(list(self.tokens[:k]), probs, list(self.confidences[:k]))

    @classmethod
    def empty(cls) -> "DraftProposal":
        return cls([], None, [])


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from any drafter (DFlash block model, n-gram, oracle, ...)."""

    capture_layers: tuple[int, ...]
    """target layers whose outputs the drafter conditions on (() = none needed)"""

    feature_window: int
    """W: how many of the latest committed positions' features it reads (0 = none); the engine
    keeps and passes at most these (a stored prefix's, a long prompt's)"""

    def admit(self, request_id: str) -> None:
        """Allocate the request's required drafter state (e.g. its draft KV ring slot)."""
        ...

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """One proposal per request, in order; each has at most `max_width - 1` tokens."""
        ...

    def observe(self, request_id: str, features: Features, start: int) -> None:
        """Features of positions start..start+rows-1 (e.g. one prefill chunk). start may skip
        positions the drafter will never read (older than its window); it never rewinds."""
        ...

    def commit(self, request_id: str, accepted: int, new_features: Features | None = None) -> None:
        """Verification accepted `accepted` drafts: positions n..n+accepted are committed.
        new_features: {layer: [accepted + 1, hidden]} target features of those positions."""
        ...

    def commit_many(self, items: Sequence["Commit"]) -> list[Exception | None]:
        """A verification round's commits at once (the engine's call): each item as `commit`, its
        failure returned in its place (None: committed) so it fails that request alone; an
        AssertionError (a violated invariant) propagates. `commit_each` loops over `commit`."""
        ...

    def release(self, request_id: str) -> None:
        """Drop all state of a finished / aborted request (no-op if unknown)."""
        ...

    def state_bytes_per_request(self) -> int:
        """Required device bytes per admitted request (for memory accounting, eq. 3)."""
        ...

    def device_bytes(self) -> "DrafterBytes":
        """Device memory the drafter holds: its own weights and its allocated state (ring)."""
        ...

    def stats(self) -> dict[str, float]:
        """The drafter's own counters, merged into the engine's stats ({} when it keeps none)."""
        ...

    def use_graphs(self, runner, max_requests: int) -> bool:
        """Capture the drafter's network now as CUDA graphs through `runner` (`models.graphs.Runner`)
        for rounds of up to `max_requests` requests, replayed where a round's shapes allow (larger
        rounds run eagerly); False: it has nothing to replay."""
        ...


class Commit(NamedTuple):
    """One request's verification outcome for its drafter: `accepted` drafts, and new_features
    {layer: [accepted + 1, hidden]} of the committed positions (None: the drafter needs none)."""

    request_id: str
    accepted: int
    new_features: Features | None = None


def commit_each(drafter: "Drafter", items: Sequence[Commit]) -> list[Exception | None]:
    """`drafter.commit` item by item: an item's exception is its result (AssertionError propagates)."""
    out: list[Exception | None] = []
    for c in items:
        try:
            drafter.commit(c.request_id, c.accepted, c.new_features)
            out.append(None)
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 - that request's own failure, returned in its place
            out.append(e)
    return out


@dataclass(frozen=True)
class DrafterBytes:
    """weights: parameters the drafter owns (not the target's embedding / head it borrows);
    state: its allocated per-request state for every slot (the draft KV ring), plus its fixed buffers
    (the DFlash family's context-projection graphs' static inputs, spec/dflash_graphs.py)."""

    weights: int = 0
    state: int = 0


class StatelessDrafter:
    """Defaults for drafters without per-request device state, feature needs or a network."""

    capture_layers: tuple[int, ...] = ()
    feature_window: int = 0

    def admit(self, request_id: str) -> None:
        return None

    def observe(self, request_id: str, features: Features, start: int) -> None:
        return None

    def commit(self, request_id: str, accepted: int, new_features: Features | None = None) -> None:
        if accepted < 0:
            raise ValueError(f"commit: accepted must be >= 0, got {accepted}")

    def commit_many(self, items: Sequence[Commit]) -> list[Exception | None]:
        return commit_each(self, items)

    def release(self, request_id: str) -> None:
        return None

    def state_bytes_per_request(self) -> int:
        return 0

    def device_bytes(self) -> DrafterBytes:
        return DrafterBytes()

    def stats(self) -> dict[str, float]:
        return {}

    def use_graphs(self, runner, max_requests: int) -> bool:
        return False
