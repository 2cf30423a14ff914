"""ORACLE DRAFTER — a benchmark MEASUREMENT TOOL, not a real drafter.

It knows the answer: it replays the target's own continuation from a reference run (greedy
output of the same model on the same prompt) and deliberately corrupts each proposed token with
probability `corrupt_rate`, so a benchmark can dial in a chosen mean acceptance and measure what
the KV path (shared retrieval, staging, ring) does at that acceptance, without training a
drafter. Never report its speedups as a drafter's; label results "oracle".

Calibration. Each draft is correct independently with probability a = 1 - c, and a corrupted
token always differs from the reference, so under greedy verification the accepted count A
among K - 1 drafts is the leading run of correct ones: P(A >= i) = a^i for i <= K - 1. A round
emits A + 1 tokens (accepted drafts + correction/bonus), so

    E[tokens per round] = 1 + sum_{i=1}^{K-1} a^i = sum_{i=0}^{K-1} a^i = (1 - a^K) / (1 - a).

`corrupt_rate_for_tokens_per_round(T, K)` inverts this (monotone in a) by bisection; 2.88 tokens
per round at width 4 gives a ~= 0.784, c ~= 0.216.
"""

from __future__ import annotations

import random
import zlib
from typing import Callable, Mapping, Sequence

from dhisparse.spec.drafter import Commit, DraftProposal, DraftRequest, StatelessDrafter

Reference = Mapping[tuple[int, ...], Sequence[int]] | Callable[[Sequence[int]], Sequence[int]]


def reference_output(reference: Reference, prompt: Sequence[int]) -> list[int] | None:
    """The reference output of a prompt (a map keyed by the prompt's ids, or a callable: one that raises
    KeyError for a prompt counts as lacking it; `bench.reference.FileReference` returns [] instead), None
    without one. The oracle and reference replay (engine/replay.py) both look prompts up through it."""
    prompt = tuple(int(t) for t in prompt)
    if callable(reference):
        try:
            ref = reference(list(prompt))
        except KeyError:
            return None
    else:
        ref = reference.get(prompt)
    return None if ref is None else [int(t) for t in ref]


def expected_tokens_per_round(accept: float, width: int) -> float:
    """sum_{i=0}^{width-1} accept^i: mean emitted tokens per round at per-draft accuracy `accept`."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return sum(accept**i for i in range(width))


def corrupt_rate_for_tokens_per_round(target_tokens_per_round: float, width: int) -> float:
    """Corruption rate c giving `target_tokens_per_round` mean emitted tokens at verification
    width K = `width` (K - 1 drafts + the bonus). Needs 1 <= target <= width."""
    if width < 1 or not 1.0 <= target_tokens_per_round <= width:
        raise ValueError(
            f"target_tokens_per_round must be in [1, width={width}] (a round emits 1..width tokens), "
            f"got {target_tokens_per_round}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, width) < target_tokens_per_round:
            lo = mid
        else:
            hi = mid
    return 1.0 - (lo + hi) / 2


class OracleDrafter(StatelessDrafter):
    """ORACLE DRAFTER (benchmark measurement tool): replays the reference continuation of each
    prompt, corrupting each proposed token with probability `corrupt_rate` (seeded per request).

    reference: {tuple(prompt ids): reference output ids} or a callable prompt ids -> output ids.
    vocab_size: corrupted tokens are drawn uniformly among the other vocab_size - 1 ids.
    If the request's output has left the reference (sampling, stop strings, or greedy tokens that
    differ from the reference run's because the batch rounded differently: a model without a
    confident head), the oracle keeps proposing the reference at the same output offset; acceptance
    then drops, as it should. `stats()` says how often that happened: the share of proposals made
    for a request already off its reference, and how many requests left it.
    """

    def __init__(self, reference: Reference, vocab_size: int, corrupt_rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError(f"OracleDrafter.corrupt_rate must be in [0, 1], got {corrupt_rate}")
        if vocab_size < 2:
            raise ValueError(f"OracleDrafter.vocab_size must be >= 2 to corrupt a token, got {vocab_size}")
        self.reference, self.vocab_size = reference, vocab_size
        self.corrupt_rate, self.seed = corrupt_rate, seed
        self._refs: dict[str, list[int]] = {}
        self._rngs: dict[str, random.Random] = {}
        self._checked: dict[str, int] = {}  # output tokens compared with the reference so far
        self._off: set[str] = set()  # live requests whose output has left their reference
        self.proposals = self.proposals_off = self.requests_off = 0

    @classmethod
    def for_tokens_per_round(cls, reference: Reference, vocab_size: int, tokens_per_round: float, width: int,
                             seed: int = 0) -> "OracleDrafter":
        """An oracle calibrated to `tokens_per_round` mean emitted tokens at `width`."""
        return cls(reference, vocab_size, corrupt_rate_for_tokens_per_round(tokens_per_round, width), seed)

    def release(self, request_id: str) -> None:
        self._refs.pop(request_id, None)
        self._rngs.pop(request_id, None)
        self._checked.pop(request_id, None)
        self._off.discard(request_id)

    def stats(self) -> dict[str, float]:
        """oracle_proposals, oracle_off_reference_share (proposals for a request whose output had
        left its reference), oracle_requests_off_reference (requests that left it, ever)."""
        share = self.proposals_off / self.proposals if self.proposals else 0.0
        return {"oracle_proposals": self.proposals, "oracle_off_reference_share": share,
                "oracle_requests_off_reference": self.requests_off}

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, req: DraftRequest) -> DraftProposal:
        ref = self._reference_of(req)
        offset = req.num_committed - req.num_prompt_tokens + 1  # output tokens so far, anchor included
        self._follow(req, ref, offset)
        truth = ref[offset: offset + req.max_drafts]
        rng = self._rngs.get(req.request_id)
        if rng is None:  # one stream a request, seeded once (a Random built every round cost 8 us a request)
            rng = self._rngs[req.request_id] = random.Random(self._stream_seed(req.request_id))
        tokens = [self._maybe_corrupt(t, rng) for t in truth]
        return DraftProposal(tokens, None, [1.0 - self.corrupt_rate] * len(tokens))

    def _follow(self, req: DraftRequest, ref: list[int], offset: int) -> None:
        """Compare the request's output tokens not compared yet (output index i: token_ids[prompt + i],
        the anchor last) with its reference; count this proposal on or off the reference."""
        rid = req.request_id
        start = self._checked.get(rid, 0)
        if rid not in self._off:
            for i in range(start, offset):
                tok = req.anchor if i == offset - 1 else int(req.token_ids[req.num_prompt_tokens + i])
                if i >= len(ref) or ref[i] != tok:
                    self._off.add(rid)
                    self.requests_off += 1
                    break
        self._checked[rid] = max(start, offset)
        self.proposals += 1
        self.proposals_off += rid in self._off

    def _reference_of(self, req: DraftRequest) -> list[int]:
        if req.request_id not in self._refs:
            ref = reference_output(self.reference, req.token_ids[: req.num_prompt_tokens])
            if ref is None:
                raise KeyError(
                    f"oracle drafter: no reference run for the prompt of request {req.request_id!r} "
                    f"({req.num_prompt_tokens} tokens); record one with a non-speculative run first"
                )
            self._refs[req.request_id] = ref
        return self._refs[req.request_id]

    def _stream_seed(self, request_id: str) -> int:
        return (self.seed * 1_000_003) ^ zlib.crc32(request_id.encode())

    def _maybe_corrupt(self, token: int, rng: random.Random) -> int:
        if rng.random() >= self.corrupt_rate:
            return token
        return (token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size


class CostedOracle:
    """COSTED ORACLE (benchmark measurement tool): a real drafter's network runs every round and
    holds its weights and ring, and the oracle's tokens replace its drafts (issue 31: drafting is
    costed, acceptance is dialled in). Every call of the drafter contract goes to `inner` (its
    features, ring and commits follow the committed tokens, whoever drafted them); `propose` runs
    inner.propose for its cost, discards its tokens and returns the oracle's proposals. What it
    still leaves out: the drafter's own acceptance (the oracle's is used) and DSpark's per-request
    width schedule (the oracle drafts the full width)."""

    def __init__(self, inner, oracle: OracleDrafter) -> None:
        self.inner, self.oracle = inner, oracle
        self.capture_layers = inner.capture_layers
        self.feature_window = inner.feature_window

    def admit(self, request_id: str) -> None:
        self.inner.admit(request_id)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        self.inner.propose(requests)  # the network's cost: its drafts are not used
        return self.oracle.propose(requests)

    def observe(self, request_id: str, features, start: int) -> None:
        self.inner.observe(request_id, features, start)

    def commit(self, request_id: str, accepted: int, new_features=None) -> None:
        self.inner.commit(request_id, accepted, new_features)

    def commit_many(self, items: Sequence[Commit]) -> list[Exception | None]:
        return self.inner.commit_many(items)

    def stats(self) -> dict[str, float]:
        return self.inner.stats() | self.oracle.stats()

    def use_graphs(self, runner, max_requests: int) -> bool:
        return self.inner.use_graphs(runner, max_requests)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)
        self.oracle.release(request_id)

    def state_bytes_per_request(self) -> int:
        return self.inner.state_bytes_per_request()

    def device_bytes(self):
        return self.inner.device_bytes()
