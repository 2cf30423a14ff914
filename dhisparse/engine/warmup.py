"""Warm-up: short requests run to completion before an engine takes real traffic.

The first forward passes of a process compile Triton kernels (tens of seconds on a cold cache on
the H200; Triton keeps compiled kernels on disk, so later processes on the same machine pay
little) and capture CUDA graphs. `dhisparse serve` runs `warm_up` before it opens its port, as
SGLang does, and the in-process benchmark runs it before the clock starts.

A speculative engine repeats the batch with longer outputs (`WARMUP_TOKENS`) until a round has
verified drafts: a drafter that finds nothing to draft in 4 tokens (n-gram lookup) would otherwise
leave the verification passes -- and their compiles -- to the first real requests.

Warm-up requests are ordinary requests: they go through admission and free their KV when they
finish, and any left at the deadline are aborted, so no state outlives the warm-up. Nor does what
speculation learnt from it: the measured round costs and the online policy's acceptance are reset
(`Engine.forget_learning`, on every rank of a parallel world). Its rounds compile and run widths
cut to 4-token outputs, and its synthetic prompts say nothing of what the drafter predicts.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from dhisparse.core.params import SamplingParams

WARMUP_TOKENS = (4, 16, 64)


class WarmupReport(NamedTuple):
    """What a warm-up ran: requests, generated tokens, wall seconds, and whether a speculative
    round verified a draft (None for an engine without speculation)."""

    requests: int
    tokens: int
    seconds: float
    drafted: bool | None


def drafted(engine) -> bool | None:
    """Whether any round of the engine's speculation verified a draft; None without speculation."""
    spec = engine.spec
    return None if spec is None else any(spec.counters.drafted_at)


def warm_up(engine, prompt_for: Callable[[int], list[int] | str], batch: int, max_tokens: int | None = None,
            timeout_s: float = 600.0) -> WarmupReport:
    """Run `batch` requests (prompts `prompt_for(0..)`) to completion, once with 4-token outputs,
    and again with 16 and 64 tokens while a speculative engine has verified no draft.

    max_tokens caps each round's output (a workload's output cap); timeout_s bounds the whole
    warm-up: requests still unfinished then are aborted (their KV is freed) and the report says
    how far it got.
    """
    if batch < 1:
        raise ValueError(f"warm-up batch must be >= 1; got {batch}")
    t0, deadline = time.perf_counter(), time.perf_counter() + timeout_s
    requests = tokens = 0
    for rnd, n_tok in enumerate(WARMUP_TOKENS):
        if rnd and drafted(engine) is not False:  # no speculation, or a round already verified drafts
            break
        params = SamplingParams(max_tokens=min(n_tok, max_tokens or n_tok), ignore_eos=True)
        rids = {engine.add_request(prompt_for(rnd * batch + k), params) for k in range(batch)}
        requests += len(rids)
        tokens += _drain(engine, rids, deadline)
        if time.perf_counter() >= deadline:
            break
    engine.forget_learning()  # what the warm-up taught the width policies is not about real traffic
    return WarmupReport(requests, tokens, time.perf_counter() - t0, drafted(engine))


def _drain(engine, rids: set[str], deadline: float) -> int:
    """Step until `rids` finish or the deadline passes (then abort the rest); tokens generated."""
    tokens = 0
    while rids and time.perf_counter() < deadline:
        for out in engine.step():
            if out.request_id in rids:
                tokens += len(out.new_token_ids)
                if out.finished:
                    rids.discard(out.request_id)
    for rid in rids:
        engine.abort(rid)
    return tokens


WARMUP_TEXT = "dhisparse warm-up: the quick brown fox jumps over the lazy dog. "


def server_prompt(engine, index: int, max_tokens: int = WARMUP_TOKENS[-1]) -> list[int]:
    """A short repetitive prompt (n-gram lookup finds repeats in it) that fits `max_model_len`
    with `max_tokens` of output; `index` varies its first token so a batch is not one prompt."""
    ids = engine.encode_prompt(WARMUP_TEXT * 2)
    room = max(1, engine.max_model_len - max_tokens)
    ids = ids[:room]
    ids[0] = ids[(index % len(ids))]
    return ids


def warm_up_server(engine, batch: int = 1, timeout_s: float = 600.0) -> WarmupReport:
    """`warm_up` with `server_prompt`, output capped to what max_model_len leaves: what
    `dhisparse serve` runs before it opens its port (skip it with --skip-server-warmup)."""
    cap = max(1, min(WARMUP_TOKENS[-1], engine.max_model_len - 1))
    return warm_up(engine, lambda i: server_prompt(engine, i, cap), batch, max_tokens=cap, timeout_s=timeout_s)
