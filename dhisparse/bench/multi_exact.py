"""The exactness check of parallel worlds (tests/test_parallel_cuda.py; issue 32): every prompt's greedy tokens from a
world (`greedy_outputs`) against one GPU's (`compare_tokens`: the first divergence of each request and the
reference's logprob margin there, so a near-tie can be told from a broken path).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Greedy:
    """One request's generated token ids and, when asked for, one TokenLogprob per token."""

    token_ids: list
    logprobs: list


def greedy_outputs(cfg, prompts, params, on_engine: str | None = None) -> list[Greedy]:
    """Every prompt's tokens (input order) from the engine or world `cfg` builds, closed after. The
    logprobs are gathered from every report (a RequestOutput's own `logprobs` are its last
    report's only)."""
    from dhisparse.engine.launch import build

    engine = build(cfg, on_engine=on_engine)
    try:
        rids = [engine.add_request(list(p), params) for p in prompts]
        got = {r: Greedy([], []) for r in rids}
        while engine.has_unfinished():
            for o in engine.step():
                g = got.get(o.request_id)
                if g is not None:
                    g.token_ids.extend(o.new_token_ids)
                    g.logprobs.extend(o.logprobs or [])
        return [got[r] for r in rids]
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def compare_tokens(reference: list, got: list, tie_margin: float = 1e-4) -> dict:
    """Token ids of `got` against `reference` (`Greedy`s). A request that diverges is reported
    with its first differing position and the reference's logprob margin there (its token's logprob
    minus the other token's, or minus its runner-up's when the other is not in its top list: the
    reference needs SamplingParams(logprobs >= 1)); `tie`: margin <= tie_margin (a near-tie that
    rounding may flip). equal: every token the same."""
    diverged = []
    for i, (a, b) in enumerate(zip(reference, got)):
        ta, tb = list(a.token_ids), list(b.token_ids)
        if ta == tb:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        margin = None
        lps = getattr(a, "logprobs", None)
        if lps and pos < len(lps) and pos < len(tb):
            lp = lps[pos]
            other = dict(lp.top).get(tb[pos])
            if other is None and len(lp.top) > 1:
                other = sorted((v for _, v in lp.top), reverse=True)[1]
            margin = None if other is None else float(lp.logprob - other)
        diverged.append({"request": i, "position": pos, "reference_token": ta[pos] if pos < len(ta) else None,
                         "got_token": tb[pos] if pos < len(tb) else None, "margin": margin,
                         "tie": margin is not None and margin <= tie_margin})
    return {"equal": not diverged and len(reference) == len(got), "requests": len(reference), "diverged": diverged}
