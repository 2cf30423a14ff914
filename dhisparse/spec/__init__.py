"""Speculative decoding: drafters (DFlash block model, DSpark scheduling, n-gram, oracle), the
draft KV ring (eq. 9-10), acceptance / commit (eq. 7-8) and width policies (eq. 13)."""

from dhisparse.spec.config import SpecConfig, SpecConfigError
from dhisparse.spec.drafter import DraftProposal, DraftRequest, Drafter
from dhisparse.spec.factory import build_drafter
from dhisparse.spec.verify import (
    Acceptance, commit_rows, verify_batch, verify_greedy, verify_request, verify_sampled,
)

__all__ = [
    "Acceptance", "DraftProposal", "DraftRequest", "Drafter", "SpecConfig", "SpecConfigError",
    "build_drafter", "commit_rows", "verify_batch", "verify_greedy", "verify_request", "verify_sampled",
]
