"""REFERENCE REPLAY: a benchmark MEASUREMENT TOOL, not a serving mode (`EngineConfig.replay_reference`).

Every request whose prompt has a reference output (the oracle's reference: the same model's greedy
output of that prompt, decoded once in one batch) emits the reference's tokens in place of its own. The
target still runs every pass, computes its logits and picks its own token (so a step costs what it
costs), and a verification round still judges the drafts, against the reference's tokens instead of the
target's argmax. Why: the oracle drafter replays a reference to set acceptance, and a served request
decodes in other batches than the reference did. With a random-weight model whose greedy margins are
last-bit small (glm5-faithful's full head at 100K: mean 0.067, exact ties), batch-dependent rounding
turns into other tokens, the request leaves its reference, and the oracle's drafts stop matching
(session 42 on the H200: 94.7% of proposals off the reference, 1.08 tokens a round set to 2.88).
Replayed, every preset decodes the same tokens as the reference, so the presets compare on the same
histories and the oracle's acceptance is the one set.

What it leaves out: the tokens are not the target's own, so a serving run no longer shows exactness.
`agreement` keeps the check that matters for the KV path: the share of emitted positions whose history
is the reference's where the target's own token equals the reference's (one a sampled step, a round's
first position). Batch rounding is expected to cost a few percent of it; a broken KV path would take it
towards 1 / vocab.
Label every result that uses it "replayed".
"""

from __future__ import annotations

from typing import Sequence

from dhisparse.spec.oracle import Reference, reference_output
from dhisparse.spec.verify import Acceptance, greedy_acceptance


class ReferenceReplay:
    """The reference outputs of an engine's prompts, forced on its requests' emitted tokens.

    A request with no reference for its prompt decodes as usual (`missing` counts them); past the end
    of its reference, too. Lookups are cached by request id (hashing a 100K-token prompt every step
    would cost milliseconds); `forget` drops a finished request's entry."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self._refs: dict[str, list[int] | None] = {}
        self.forced = 0  # emitted tokens that came from the reference
        self.judged = 0  # positions whose history was the reference's, target's own token compared
        self.agreed = 0  # ... and equal to the reference's
        self.missing = 0  # requests without a reference output

    def of(self, request_id: str, prompt_ids: Sequence[int]) -> list[int] | None:
        """The reference output of a request's prompt (cached), None without one."""
        if request_id not in self._refs:
            ref = reference_output(self.reference, prompt_ids)  # none: the model decides
            self._refs[request_id] = ref
            self.missing += ref is None
        return self._refs[request_id]

    def forget(self, request_id: str) -> None:
        self._refs.pop(request_id, None)

    def sampled(self, request_id: str, prompt_ids: Sequence[int], position: int, token: int) -> int:
        """The token a sampled step emits at output `position`: the reference's where it has one."""
        ref = self.of(request_id, prompt_ids)
        if ref is None or position >= len(ref):
            return token
        self._judge(token == ref[position])
        self.forced += 1
        return ref[position]

    def verified(self, request_id: str, prompt_ids: Sequence[int], position: int, drafts: Sequence[int],
                 own: Acceptance) -> Acceptance:
        """A round's acceptance with the reference's tokens as the target's, judged greedily (the reference
        is a greedy output; a sampled request is judged the same way): drafts d_1..d_{K-1} for output
        positions `position`.. are accepted while they equal the reference, and the next token is the
        reference's. `own`: the round judged against the target's argmax (its first emitted token
        is the target's own at `position`, whose history is the reference's)."""
        ref = self.of(request_id, prompt_ids)
        if ref is None or position + len(drafts) >= len(ref):
            return own
        self._judge(own.emitted[0] == ref[position])
        acc = greedy_acceptance(ref[position : position + len(drafts) + 1], drafts)
        self.forced += len(acc.emitted)
        return acc

    def _judge(self, agree: bool) -> None:
        self.judged += 1
        self.agreed += agree

    def stats(self) -> dict:
        """`replay_*` counters: tokens forced, the target's agreement with the reference, requests
        without one."""
        return {"replay_forced_tokens": self.forced, "replay_judged": self.judged,
                "replay_agreement": self.agreed / self.judged if self.judged else 0.0,
                "replay_missing_requests": self.missing}
