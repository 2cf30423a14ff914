"""Prefill/decode disaggregation on one engine (engine/disagg.py runs the ranks).

A prefill engine's `keep_prompt` requests: once the first token is sampled, the whole prompt's
KV and sampling state wait in `Engine.kept_prompts` (`PromptKV`) for the caller to send.
A decode engine's arrived prompts (`add_prompt_kv`): queued like any request, the whole prompt
imported at admission, the first token reported then (`report_first_token`), decoding from it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dhisparse.core.params import SamplingParams
from dhisparse.engine.disagg_kv import PromptKV, whole_prompt
from dhisparse.engine.disagg_v4 import whole_state
from dhisparse.engine.prefixes import store_export
from dhisparse.engine.request import Request
from dhisparse.kv.memory.prefix_store import StoredPrefix
from dhisparse.kv.v4.prefix import V4Prefix

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def add_prompt_kv(eng: Engine, kv: PromptKV, params: SamplingParams, request_id: str) -> str:
    """Queue a request whose whole prompt's KV and first token came from a prefill engine
    (`Engine.add_prompt_kv`)."""
    if params.max_tokens < 2:
        raise ValueError(f"request {request_id!r}: a request handed over after its first token needs max_tokens >= 2")
    if eng.spec is not None and not eng.spec.serves(kv.item):
        raise ValueError(f"request {request_id!r}: its prompt KV lacks the hidden features the drafter reads")
    rid = eng.add_request(list(kv.item.token_ids), params, request_id)
    req = eng.requests[rid]
    req.generator.set_state(kv.generator_state)
    req.prompt_logprobs = kv.prompt_logprobs
    eng._matches[rid] = (kv.item, kv.prompt_len)
    eng._arrived[rid] = kv
    return rid


def report_first_token(eng: Engine, req: Request) -> None:
    """An arrived request was just admitted: its placement is noted, its first token reported
    with this step's outputs and decoded from in this step's chunks. Nothing for other requests."""
    kv = eng._arrived.pop(req.request_id, None)
    if kv is None:
        return
    eng.arrival_placements[req.request_id] = eng.store.prompt_chunk_limit(req.request_id) is not None
    if req.matcher is not None:
        req.matcher.consume([kv.first_token])
    eng._first_outputs.append(eng._append_tokens(req, [kv.first_token], time.perf_counter(), kv.logprobs))


def prompt_rows(eng: Engine, req: Request) -> StoredPrefix | V4Prefix:
    """A keep_prompt request's whole prompt as host rows (`whole_prompt`), with the drafter's features;
    a DeepSeek-V4 store's own export instead (its whole streaming state, engine/disagg_v4.py)."""
    feats, own = store_export(eng, req)
    if own is not None:
        return whole_state(own)
    latent, index = eng.store.read_rows(req.request_id, len(req.prompt_ids), eng.prefixes.pin)
    return whole_prompt(req.prompt_ids, latent, index, feats, eng.prefixes.pin)


def keep_prompts(eng: Engine, reqs: list[Request]) -> None:
    """keep_prompt requests whose first token was just sampled -> `kept_prompts` (one that failed
    is reported as failed and keeps nothing)."""
    now = time.time()
    for req in reqs:
        item = eng._keeping.pop(req.request_id, None)
        if item is None or req.error is not None or not req.output_ids:
            continue
        queue = (req.admitted_at or req.arrival) - req.arrival
        eng.kept_prompts[req.request_id] = PromptKV(item, req.output_ids[0], req.generator.get_state(),
                                                    None, req.prompt_logprobs, req.imported_len, queue, now)
