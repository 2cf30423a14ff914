"""A step's model pass(es) (steps 4 and 6 of docs/structure.md): the scheduled chunks flattened into
`ForwardBatch`es, each with its KV context from the store, run through a whole-step graph where
one is captured (`engine/step_graphs.py`, step 6a) and eagerly otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.engine.scheduler import Chunk
from dhisparse.models.dsa import ModelOutput

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def forward(eng: Engine, chunks: list[Chunk]) -> tuple[list[Chunk], list[int], ModelOutput]:
    """The step's model pass(es): (chunks in pass order, their N+1 token offsets, output).
    With step graphs a mixed step runs as two passes, its decodes (replayed from a graph) and
    then its prefill chunks (eagerly), so a few prompt tokens do not send every decode down
    the eager path. Requests are independent, so the split changes no result."""
    capture = eng.spec.capture if eng.spec else ()
    parts = eng._split(chunks)
    outs, qs = [], [0]
    for part in parts:
        batch = ForwardBatch.build([(c.tokens, c.start) for c in part], eng.device)
        ctx = eng.store.context(batch, [c.req.request_id for c in part])
        out = eng.step_graphs.forward(batch, ctx, capture) if eng.step_graphs is not None else None
        outs.append(out if out is not None else eng.model(batch, ctx, capture_layers=capture))
        base = qs[-1]
        qs.extend(base + x for x in batch.query_start[1:])
    ordered = [c for part in parts for c in part]
    if len(outs) == 1:
        return ordered, qs, outs[0]
    captured = {l: torch.cat([o.captured[l] for o in outs]) for l in outs[0].captured}
    return ordered, qs, ModelOutput(torch.cat([o.hidden for o in outs]), captured)


def split(eng: Engine, chunks: list[Chunk]) -> list[list[Chunk]]:
    """The chunks of one step as passes: one, or with step graphs decodes and prefill apart."""
    return [chunks] if eng.step_graphs is None else eng.step_graphs.split(chunks)
