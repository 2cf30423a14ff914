"""Speculative decoding: the `Drafter` contract (`drafter.py`) and the drafters (DFlash block
model, DSpark scheduling, n-gram, the benchmark-only oracle), the draft KV ring (eq. 9-10),
acceptance / commit (eq. 7-8), width policies (eq. 13) and `build_drafter` (`factory.py`). May
import `core`, `kernels`, `kv`, `layers` and `models`; the engine drives it."""

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
