"""What speculation costs in sessions: eq. 13's memory term, from the engine's own pools.

Speculation holds device memory for the engine's whole life: the drafter's weights, its state
(the draft KV ring, allocated for every request slot) and the verification staging arena (pool
pages held for good). A non-speculative engine on the same GPU could give all of it to the KV
pool, so at full load the two configurations hold

    b_s = pool_bytes // session_bytes                       sessions with speculation
    b_0 = (pool_bytes + spec_bytes) // session_bytes        sessions without it

where pool_bytes is what requests can hold (the pool less its permanent pages) and session_bytes a
session's required pages at max_model_len (`KVStore.pages_for(max_model_len, 0)`: hot cache, tail and
index history under the hierarchy; the whole history under `resident`). Eq. 13 then says speculation
pays at full load when TPOT_0 / TPOT_s > b_0 / b_s.

This is a deployment decision, not a run-time one: the engine does not give speculation's memory
back when the online policy runs a width-1 round, so at run time b_s / b_0 is 1 and the online
policy (spec/policy.py) is built without a memory model. The start-up log and `stats()` report the
deploy-time figures (`spec_bytes`, `sessions_fit_spec`, `sessions_fit_no_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dhisparse.spec.policy import MemoryModel


@dataclass(frozen=True)
class SpecMemory:
    """Bytes speculation holds and the sessions of max_model_len each configuration fits."""

    drafter_weights: int
    drafter_state: int
    staging: int  # the staging arena's pool pages, in bytes
    pool_bytes: int
    session_bytes: int

    @property
    def spec_bytes(self) -> int:
        return self.drafter_weights + self.drafter_state + self.staging

    def model(self) -> MemoryModel:
        """The same figures as the policy's `MemoryModel` (capacity = pool + speculation's bytes)."""
        return MemoryModel(self.pool_bytes + self.spec_bytes, self.session_bytes, 0, self.spec_bytes)

    def sessions(self, speculative: bool) -> int:
        """b_s (speculative) or b_0: sessions of max_model_len that fit at full load."""
        return self.model().sessions(1 << 62, speculative)

    def counters(self) -> dict:
        return {"spec_bytes": self.spec_bytes, "spec_staging_bytes": self.staging,
                "sessions_fit_spec": self.sessions(True), "sessions_fit_no_spec": self.sessions(False)}

    def note(self) -> str:
        """One start-up log line."""
        gib = 1 << 30
        bs, b0 = self.sessions(True), self.sessions(False)
        bar = f"TPOT_0 / TPOT_s > {b0 / bs:.3f}" if bs else "never (no session fits with it)"
        return (f"speculation holds {self.spec_bytes / gib:.3f} GiB (drafter weights {self.drafter_weights / gib:.3f}, "
                f"state {self.drafter_state / gib:.3f}, staging {self.staging / gib:.3f}): {bs} sessions of max_model_len "
                f"fit with it, {b0} without; at full load it pays when {bar} (eq. 13)")


def spec_memory(store, drafter_bytes, page_bytes: int, max_model_len: int, fixed_pages: int = 0) -> SpecMemory:
    """From the engine's store (its pool usage and pages per session; `fixed_pages` the engine's
    own permanent pages, e.g. the step graphs' scratch: every other permanent page is the
    verification staging arena, GLM's or DeepSeek-V4's) and the drafter's `device_bytes()`."""
    u = store.usage()
    stage_pages = max(0, u.permanent - fixed_pages)
    pool = max(0, u.total - u.permanent) * page_bytes  # what requests can hold
    return SpecMemory(drafter_bytes.weights, drafter_bytes.state, stage_pages * page_bytes, pool,
                      max(1, store.pages_for(max_model_len, 0) * page_bytes))
