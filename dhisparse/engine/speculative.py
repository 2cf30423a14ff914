"""Speculative decoding inside the engine step (paper §3.3, eq. 5-7).

Per round, each decoding request's single anchor token becomes a verification chunk
[anchor, d_1 .. d_{K_r - 1}] at positions n .. n + K_r - 1 (one target pass for all requests; each
query keeps its own causal boundary because the indexer masks positions after it). After the pass,
the drafts are accepted by the request's own rule (greedy prefix, or rejection sampling), the
committed frontier moves to n' = n + 1 + A (eq. 7) and only those rows become history: the store
backs up / publishes rows below n' only; rows at n' and beyond are never published and are
overwritten by the next round. The drafter advances with the same accepted prefix (I5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dhisparse.engine.scheduler import Chunk
from dhisparse.spec.config import SpecConfig
from dhisparse.spec.drafter import Commit, DraftProposal, DraftRequest
from dhisparse.spec.dspark import VerifyCost
from dhisparse.spec.factory import build_drafter, static_schedule
from dhisparse.spec.policy import OnlineWidthPolicy
from dhisparse.spec.verify import Acceptance, verify_batch


@dataclass
class SpecCounters:
    """rounds: verification rounds; emitted: tokens they emitted; accepted_at[i]: rounds whose
    i-th draft was accepted; drafted_at[i]: rounds that verified an i-th draft."""

    rounds: int = 0
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    draft_calls: int = 0  # drafter.propose calls (one per step that verifies)
    draft_seconds: float = 0.0  # wall time inside them (their device work included: proposals are host lists)
    width_steps: dict[int, int] = field(default_factory=dict)  # decoding steps by the width chosen for them

    def add(self, width: int, acc: Acceptance) -> None:
        self.rounds += 1
        self.emitted += len(acc.emitted)
        k = max(width - 1, 0)
        for lst in (self.accepted_at, self.drafted_at):
            lst.extend([0] * (k - len(lst)))
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < acc.accepted)

    def as_dict(self) -> dict:
        d = {"spec_rounds": self.rounds, "spec_tokens_per_round": self.emitted / self.rounds if self.rounds else 0.0,
             "spec_draft_calls": self.draft_calls, "spec_draft_seconds": self.draft_seconds,
             "spec_draft_ms_per_call": 1e3 * self.draft_seconds / self.draft_calls if self.draft_calls else 0.0}
        for i, (a, n) in enumerate(zip(self.accepted_at, self.drafted_at)):
            d[f"spec_accept_pos{i + 1}"] = a / n if n else 0.0
        for w, n in sorted(self.width_steps.items()):
            d[f"spec_steps_width{w}"] = n
        return d


class SpecRuntime:
    def __init__(self, cfg: SpecConfig, target, max_requests: int, reference=None, replay=None) -> None:
        """replay: the engine's `ReferenceReplay` (a measurement tool, engine/replay.py): rounds are
        judged against the reference's tokens."""
        self.cfg = cfg
        self.replay = replay
        self.cost = VerifyCost()  # seconds per step by width, measured online (DSpark + online policy)
        self.drafter = build_drafter(cfg, target, reference=reference, max_requests=max_requests, cost=self.cost)
        self.online = OnlineWidthPolicy(cfg.num_draft_tokens, self.cost, widths=cfg.online_candidates()) if cfg.policy == "online" else None
        self._step_width = 0
        self._clipped = False  # this step cut a request's width to its remaining max_tokens
        self.capture = tuple(self.drafter.capture_layers)
        self.schedule = static_schedule(cfg)
        self.counters = SpecCounters()
        self.proposals: dict[str, DraftProposal] = {}
        self._kept: dict[str, dict[int, torch.Tensor]] = {}

    def stats(self) -> dict:
        """Acceptance, steps by chosen width (`spec_steps_width{w}`, 1 = speculation off), the
        measured round cost by width (`spec_cost_ms_width{w}`, the drafter's proposal included, flagged by
        `spec_cost_with_draft` = 1; what the online policy and DSpark price widths with), drafter cost (time per propose call, device bytes of its weights and state)
        and the drafter's own counters (`Drafter.stats`: the oracle's off-reference share)."""
        mem = self.drafter.device_bytes()
        costs = {f"spec_cost_ms_width{w}": 1e3 * s for w, s in self.cost.measured.items()} | {"spec_cost_with_draft": 1}
        return (self.counters.as_dict() | costs | {"drafter_weight_bytes": mem.weights, "drafter_state_bytes": mem.state}
                | self.drafter.stats())

    def forget_learning(self) -> None:
        """Back to the priors: the online policy's acceptance and every measured round cost. Run
        after an engine's warm-up (`engine.warmup.warm_up`): its rounds compile kernels and run
        widths cut to 4-token outputs (session 23 on the H200: they left a ~0-ms width-1 cost and
        eager widths at 300-510 ms in the table, which priced speculation off for seconds), and
        its synthetic prompts say nothing of what the drafter predicts on real traffic."""
        self.cost.clear()
        if self.online is not None:
            self.online.reset()

    def width(self, running: int) -> int:
        """Verification width this round: fixed (K_max), static by load, or the online policy's
        choice from measured acceptance and step cost (1 = speculation off)."""
        if self.online is not None:
            return self.online.decide(running).width
        if self.cfg.policy == "static":
            return self.schedule.width(running, self.cfg.num_draft_tokens)
        return self.cfg.fixed_width or self.cfg.num_draft_tokens

    def expand(self, chunks: list[Chunk], running: int) -> list[Chunk]:
        """Turn decode chunks into verification chunks [anchor + drafts]."""
        decodes = [i for i, c in enumerate(chunks) if c.decodes]
        if not decodes:
            return chunks
        width = self.width(running)
        self.counters.width_steps[width] = self.counters.width_steps.get(width, 0) + 1
        reqs = []
        self._clipped = False
        for i in decodes:
            r = chunks[i].req
            w = max(1, min(width, r.params.max_tokens - len(r.output_ids)))
            self._clipped |= w < width
            reqs.append(DraftRequest.from_parts(r.request_id, r.prompt_ids, r.output_ids, w, params=r.params,
                                                num_prompt_tokens=len(r.prompt_ids)))
        out = list(chunks)
        t0 = time.perf_counter()
        proposals = self.drafter.propose(reqs)
        self.counters.draft_calls += 1
        self.counters.draft_seconds += time.perf_counter() - t0
        for i, req, prop in zip(decodes, reqs, proposals):
            prop = prop.truncated(min(len(prop.tokens), req.max_drafts))
            self.proposals[req.request_id] = prop
            c = chunks[i]
            out[i] = Chunk(c.req, c.start, [req.anchor, *prop.tokens], c.sample, True)
        return out

    def keep_features(self, request_id: str, captured: dict[int, torch.Tensor], a: int, b: int) -> None:
        """Accumulate a prefix-export request's features (the last W positions are kept)."""
        if not self.capture:
            return
        kept = self._kept.setdefault(request_id, {})
        for l in self.capture:
            kept[l] = torch.cat([kept[l], captured[l][a:b]]) if l in kept else captured[l][a:b]
            kept[l] = kept[l][-self.drafter.feature_window :]

    def serves(self, item) -> bool:
        """Whether a stored prefix carries the hidden features this drafter reads when a request
        imports it (`observe_import`): every captured layer, for its last min(length, W) positions.
        A prefix that does not is prefilled instead of imported."""
        if not self.capture:
            return True
        need = min(len(item.token_ids), self.drafter.feature_window)
        return all(l in item.features and item.features[l].shape[0] >= need for l in self.capture)

    def take_features(self, request_id: str) -> dict:
        return self._kept.pop(request_id, {})

    def observe_import(self, request_id: str, item, n: int) -> None:
        """A request imported n rows of a stored prefix: give the drafter the stored features of the
        imported positions inside its window."""
        if not self.capture or not item.features:
            return
        f = next(iter(item.features.values())).shape[0]
        first = len(item.token_ids) - f  # position of the first stored feature row
        if n <= first:
            return
        self.drafter.observe(request_id, {l: t[: n - first] for l, t in item.features.items()}, first)

    def observe_prefill(self, chunk: Chunk, captured: dict[int, torch.Tensor], a: int, b: int) -> None:
        if self.capture:
            self.drafter.observe(chunk.req.request_id, {l: captured[l][a:b] for l in self.capture}, chunk.start)

    def verify(self, chunks: list[tuple[Chunk, int, int]], logits: torch.Tensor) -> list[Acceptance]:
        """chunks: (chunk, first row, end row) of verification chunks; logits rows concatenated."""
        qs = [0]
        for _, a, b in chunks:
            qs.append(qs[-1] + b - a)
        props = [self.proposals.pop(c.req.request_id) for c, _, _ in chunks]
        accs = verify_batch(logits, qs, [p.tokens for p in props], [p.probs for p in props],
                            [c.req.params for c, _, _ in chunks], [c.req.generator for c, _, _ in chunks])
        if self.replay is not None:
            accs = [self.replay.verified(c.req.request_id, c.req.prompt_ids, len(c.req.output_ids), c.tokens[1:], acc)
                    for (c, _, _), acc in zip(chunks, accs)]
        for (c, _, _), acc in zip(chunks, accs):
            self.counters.add(len(c.tokens), acc)
            if self.online is not None and len(c.tokens) > 1:
                self.online.observe(len(c.tokens), acc.accepted)
        self._step_width = max((len(c.tokens) for c, _, _ in chunks), default=0)
        return accs

    def observe_step(self, seconds: float, decode_only: bool = True) -> None:
        """Feed the measured time of a step that decoded (width = its widest verification), from before
        its drafter proposed to its outputs: a round's cost is drafting plus verification, as eq. 13
        prices it (before session 42 the proposal was left out, which priced a network drafter's rounds
        low by its forward: 13.4 of ~189 ms on glm5-faithful at C20, session 36). Not
        fed: a step that also prefilled (it says nothing about a round's cost at that width), and
        one that cut a request's width to its remaining max_tokens (its widest chunk is then a
        width no graph was captured for, run eagerly: on the H200 at 8K, 300-500 ms at width 3
        against 31-58 ms at 8, which priced the widths between by interpolation)."""
        if self._step_width and decode_only and not self._clipped:
            self.cost.update(self._step_width, seconds)
        self._step_width = 0
        self._clipped = False

    def commit_all(self, done: list[tuple[Chunk, Acceptance, int]], captured: dict[int, torch.Tensor]) -> list[Exception | None]:
        """A round's commits in one `Drafter.commit_many` call: (chunk, acceptance, first row of its
        captured features) each; returns each one's failure (None: committed)."""
        items = [Commit(c.req.request_id, acc.accepted,
                        {l: captured[l][a : a + acc.committed] for l in self.capture} if self.capture else None)
                 for c, acc, a in done]
        return self.drafter.commit_many(items)

    def admit(self, request_id: str) -> None:
        self.drafter.admit(request_id)

    def release(self, request_id: str) -> None:
        self.proposals.pop(request_id, None)
        self.drafter.release(request_id)
