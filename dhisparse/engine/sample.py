"""Sampling in the step (step 7 of docs/structure.md): the next token of every chunk that ends at
its request's last token (`core/sampling.py`: the logit processors, the per-request generators),
its grammar advanced and its logprobs taken; and the logprobs of the prompt tokens a prefill
chunk predicts. A request whose draw or grammar fails fails alone."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from dhisparse.core.logits import needs_history, token_logprobs
from dhisparse.engine.finish import fail
from dhisparse.engine.request import RequestOutput
from dhisparse.engine.scheduler import Chunk

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def sample(eng: Engine, sampled: list[tuple[Chunk, int]], hidden: torch.Tensor) -> list[RequestOutput]:
    """Sample the next token of each (chunk, flattened index of its last token)."""
    if not sampled:
        return []
    reqs = [c.req for c, _ in sampled]
    idx = [i for _, i in sampled]
    if idx != list(range(hidden.shape[0])):  # a decode pass samples every row, in order
        hidden = hidden.index_select(0, torch.tensor(idx).to(hidden.device, non_blocking=True))  # no sync
    logits = eng.model.logits(hidden)
    params = [r.params for r in reqs]
    hist = [r.history() if needs_history(p) else None for r, p in zip(reqs, params)]
    sample = eng.sampler.sample(logits, params, [r.generator for r in reqs],
                                hist if any(h is not None for h in hist) else None)
    tokens, now = sample.tokens.tolist(), time.perf_counter()
    if eng.replay is not None:  # a measurement tool (engine/replay.py): the reference's tokens are emitted
        tokens = [eng.replay.sampled(r.request_id, r.prompt_ids, len(r.output_ids), t) for r, t in zip(reqs, tokens)]
    failed = dict(sample.failed)
    for i, r in enumerate(reqs):
        if r.matcher is not None and i not in failed:
            try:
                r.matcher.consume([tokens[i]])
            except Exception as e:  # noqa: BLE001 - that request alone fails
                failed[i] = f"grammar: {type(e).__name__}: {e}"
    lps: list = [None] * len(reqs)
    want = [i for i, p in enumerate(params) if p.logprobs is not None and i not in failed]
    if want:
        rows = logits if len(want) == len(reqs) else logits[torch.tensor(want, device=logits.device)]
        for i, lp in zip(want, token_logprobs(rows, [tokens[i] for i in want], [params[i].logprobs for i in want])):
            lps[i] = [lp]
    return [fail(eng, r, failed[i]) if i in failed else eng._append_tokens(r, [tok], now, lps[i])
            for i, (r, tok) in enumerate(zip(reqs, tokens))]


def prompt_logprobs(eng: Engine, c: Chunk, hidden: torch.Tensor, a: int, b: int) -> None:
    """Logprobs of the prompt tokens this prefill chunk predicts (row j -> position start+j+1)."""
    prompt = c.req.prompt_ids
    n = min(b - a, len(prompt) - 1 - c.start)
    if n <= 0:
        return
    logits = eng.model.logits(hidden[a : a + n])
    toks = prompt[c.start + 1 : c.start + 1 + n]
    c.req.prompt_logprobs.extend(token_logprobs(logits, toks, [c.req.params.prompt_logprobs] * n))
