"""One engine step (`Engine.step`): schedule (admit + chunks) -> build ForwardBatch -> KV context
from the store -> model forward -> logits at the last token of chunks that complete a request's
pending tokens -> sample / verify -> stop checks -> outputs; finished requests free their KV.

The phases that tools time or wrap (bench/host_phases.py: `_forward`, `_verify`, `_sample`,
`_append_tokens`, `_commit`, `_step`; tests: `_split`) are called through the Engine's methods,
so a wrapper installed on an engine instance sees every call.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dhisparse.core.contracts import RequestFailures
from dhisparse.engine.finish import fail, fail_pending
from dhisparse.engine.handoff import keep_prompts, prompt_rows
from dhisparse.engine.prefixes import export
from dhisparse.engine.request import RequestOutput, Status
from dhisparse.engine.sample import prompt_logprobs
from dhisparse.engine.scheduler import Chunk
from dhisparse.layers.ep_moe import idle_pass
from dhisparse.models.dsa import ModelOutput

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine

log = logging.getLogger("dhisparse.engine")


def run_step(eng: Engine) -> list[RequestOutput]:
    """`Engine.step`: the outputs of every request that advanced or finished; a failed batched
    pass finishes that pass's requests with "error" (not under expert parallelism's lockstep,
    whose peers are inside the same pass); an AssertionError propagates."""
    held, eng._held_outputs = eng._held_outputs, []
    chunks = eng.scheduler.schedule()
    failed = fail_pending(eng)
    failed, eng._first_outputs = failed + eng._first_outputs, []
    chunks = [c for c in chunks if c.req.status is not Status.FINISHED]
    if eng.lockstep is not None and eng.lockstep(bool(chunks)) and not chunks:
        idle_pass(eng.model, eng.model.dtype, eng.device)  # others run a pass: join its MoE exchanges
    if not chunks:
        eng.store.idle()  # nothing to run: settle copies in flight (an idle pool holds no dead pages)
        return held + failed
    try:
        outs = held + failed + eng._step(chunks)
    except AssertionError:  # a violated invariant or debug check: never a request's own fault
        raise
    except Exception as e:  # noqa: BLE001 - the batched pass failed: its requests fail, the engine serves on
        if eng.lockstep is not None:  # peers are inside the same pass's exchanges: the group cannot go on
            raise
        log.exception("engine step failed; its %d requests are aborted", len(chunks))
        msg = f"engine step failed: {type(e).__name__}: {e}"
        return held + failed + [fail(eng, c.req, msg) for c in chunks if c.req.status is not Status.FINISHED]
    if not eng.has_unfinished():
        eng.store.idle()  # the last request just finished: its draining pages go now
    return outs


def step_pass(eng: Engine, chunks: list[Chunk]) -> list[RequestOutput]:
    """The scheduled chunks through the model and out as outputs (`Engine._step`)."""
    t_start = time.perf_counter()  # a round's cost includes its drafting (eq. 13 prices the whole round)
    if eng.spec is not None:
        chunks = eng.spec.expand(chunks, len(eng.scheduler.running))
    chunks, qs, out = eng._forward(chunks)
    eng.store.before_sync()  # KV upkeep that needs no result of this step runs while it computes
    eng._steps += 1
    eng._peak = max(eng._peak, eng.store.usage().used - eng._fixed_pages)
    sampled, verifying = _advance(eng, chunks, qs, out)
    accs = eng._verify(verifying, out.hidden)
    _export_prompts(eng, sampled)
    _upkeep(eng, chunks)
    outputs = _report(eng, sampled, verifying, accs, out)
    _observe(eng, chunks, outputs, t_start)
    return outputs


def _advance(eng: Engine, chunks: list[Chunk], qs: list[int], out: ModelOutput):
    """Move every non-verification chunk's frontier and take what its prefill rows give (the
    drafter's features, prompt logprobs): (sampled (chunk, last row), verifying (chunk, a, b))."""
    sampled: list[tuple[Chunk, int]] = []
    verifying: list[tuple[Chunk, int, int]] = []
    for i, c in enumerate(chunks):
        a, b = qs[i], qs[i + 1]
        if c.verify:
            verifying.append((c, a, b))
            continue
        eng._prefilled += max(0, min(len(c.req.prompt_ids), c.start + len(c.tokens)) - c.start)
        c.req.num_computed = c.start + len(c.tokens)
        if eng.spec is not None and not c.decodes:
            eng.spec.observe_prefill(c, out.captured, a, b)
            if c.req.export_prefix or c.req.request_id in eng._keeping:
                eng.spec.keep_features(c.req.request_id, out.captured, a, b)
        if c.req.prompt_logprobs is not None and not c.decodes:
            prompt_logprobs(eng, c, out.hidden, a, b)
        if c.sample:
            sampled.append((c, b - 1))
    return sampled, verifying


def _export_prompts(eng: Engine, sampled: list[tuple[Chunk, int]]) -> None:
    """Complete prompts that are kept: as prefixes (`export_prefix`), or for a decode engine
    (`keep_prompt`), read before the store's hand-off moves the workspace."""
    for c, _ in sampled:
        if c.req.export_prefix:
            export(eng, c.req)
        elif c.req.request_id in eng._keeping:  # read before the store's hand-off moves the workspace
            eng._keeping[c.req.request_id] = prompt_rows(eng, c.req)


def _upkeep(eng: Engine, chunks: list[Chunk]) -> None:
    """The store's KV upkeep of the step; a request whose own upkeep failed is recorded."""
    try:
        eng.store.after_step({c.req.request_id: (c.req.num_computed, not c.req.in_prefill) for c in chunks})
    except RequestFailures as f:  # the store did every other request's upkeep
        eng._failed.update({r: f"KV upkeep failed: {type(e).__name__}: {e}" for r, e in f.failures.items()})


def _report(eng: Engine, sampled, verifying, accs, out: ModelOutput) -> list[RequestOutput]:
    """The step's outputs: recorded failures, sampled tokens, then the verification rounds' commits."""
    outputs = fail_pending(eng)
    outputs += eng._sample([(c, i) for c, i in sampled if not c.req.export_prefix and c.req.status is not Status.FINISHED],
                           out.hidden)
    keep_prompts(eng, [c.req for c, _ in sampled])
    outputs += eng._commit([v for v in verifying if v[0].req.status is not Status.FINISHED],
                           [a for v, a in zip(verifying, accs) if v[0].req.status is not Status.FINISHED], out.captured)
    eng._verify_lps.clear()
    return outputs


def _observe(eng: Engine, chunks: list[Chunk], outputs: list[RequestOutput], t_start: float) -> None:
    """The step's costs to the width policy, its counters to the series, and the debug check."""
    if eng.spec is not None:
        eng.spec.observe_step(time.perf_counter() - t_start, all(c.decodes for c in chunks))
    eng._decoding = sum(1 for c in chunks if c.decodes)
    eng.series.observe(time.perf_counter() - eng._t0, len(outputs), eng._decoding, lambda: eng.stats().as_dict())
    if eng.config.debug_checks:
        eng.store.check_integrity()
