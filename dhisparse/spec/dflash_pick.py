"""From a DFlash-family round's block rows to proposals, per drafter kind.

    DFlash   each request's rows 1..K-1 of the LM head's logits [B-1, V]: argmax (greedy; confidence =
             softmax max) or a draw from q = processed_probs(row, params) (confidence = q(x))
    DFlash2  the candidate selector's path over rows 1..K-1 (`CandidateSelector.select`)
    DSpark   the sequential head over rows 1..K-1 (`SequentialHead.draft`)

K = min(max_width, B) per request. `gens[i]` is request i's draft generator, None when it decodes
greedily; sampled proposals carry their distributions for rejection sampling.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dhisparse.core.sampling import processed_probs
from dhisparse.spec.drafter import DraftProposal, DraftRequest


def _device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """[N] int64 on `device` without a stream sync: `torch.tensor(values, device=cuda)` copies from pageable
    memory and waits for every kernel queued before it (session 42's costed round on the H200: 8.3 ms a
    round inside `propose`, the drafter's forward, counted as host time); built on the host and copied
    non-blocking, the values are staged at once and the copy is queued behind that work."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def pick_each(reqs: Sequence[DraftRequest], gens: list, logits: torch.Tensor) -> list[DraftProposal]:
    """DFlash: logits [N, B-1, V] -> one proposal a request (its first min(max_width, B) - 1 rows)."""
    out = []
    for req, gen, rows in zip(reqs, gens, logits):
        rows = rows[:min(req.max_drafts, rows.shape[0])]
        if gen is None:
            tokens = rows.argmax(dim=-1)
            conf = torch.softmax(rows, dim=-1).gather(1, tokens[:, None])[:, 0]
            out.append(DraftProposal(tokens.tolist(), None, conf.tolist()))
            continue
        q = processed_probs(rows, [req.params] * rows.shape[0])
        tokens = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(rows.shape[0])])
        out.append(DraftProposal(tokens.tolist(), q, q.gather(1, tokens[:, None])[:, 0].tolist()))
    return out


def select_path(selector, reqs: Sequence[DraftRequest], gens: list, hidden: torch.Tensor,
                logits: torch.Tensor) -> list[DraftProposal]:
    """DFlash2: hidden [N, B-1, H], logits [N, B-1, V] -> the selector's path a request (greedy rows
    argmax, sampled rows drawn at the request's temperature; q = the selector's distribution over
    its candidates, densified)."""
    k_all = min(max(r.max_drafts for r in reqs), logits.shape[1])
    temps = [0.0 if g is None else float(r.params.temperature) for r, g in zip(reqs, gens)]
    anchors = _device_ints([r.anchor for r in reqs], logits.device)
    sel = selector.select(hidden[:, :k_all], logits[:, :k_all], anchors, temps, gens)
    tokens, confidence = sel.tokens.tolist(), sel.confidence.tolist()  # two device reads a round, not two a request
    out = []
    for row, (req, t) in enumerate(zip(reqs, temps)):
        k = min(req.max_drafts, k_all)
        probs = None if t == 0 else sel.dense_q(row, k, logits.shape[-1])
        out.append(DraftProposal(tokens[row][:k], probs, confidence[row][:k]))
    return out


def head_path(head, reqs: Sequence[DraftRequest], gens: list, hidden: torch.Tensor,
              logits: torch.Tensor) -> list[DraftProposal]:
    """DSpark: hidden [N, B-1, H], logits [N, B-1, V] -> the sequential head's drafts a request,
    confidences from its confidence head."""
    k_all = min(max(r.max_drafts for r in reqs), logits.shape[1])
    anchors = _device_ints([r.anchor for r in reqs], logits.device)
    out = head.draft(hidden[:, :k_all], logits[:, :k_all], anchors, [r.params for r in reqs], gens)
    props = []
    for row, req in enumerate(reqs):
        k = min(req.max_drafts, k_all)
        q = out.q[row]
        props.append(DraftProposal(out.tokens[row, :k].tolist(), None if q is None else q[:k],
                                   out.confidence[row, :k].tolist()))
    return props
