"""Prepared prefixes on one engine (step 3 of docs/structure.md): preparing one
(`prepare_prefix`: a prompt prefilled once, its KV exported into `Engine.prefixes`), a waiting
request's match against them (`prefix_match`, asked by the scheduler's admission and the store's
host reservation), and the export itself once the prompt's KV is complete."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dhisparse.core.params import SamplingParams
from dhisparse.engine.finish import finish
from dhisparse.engine.request import Request

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


def prepare_prefix(eng: Engine, prompt: str | list[int]) -> int:
    """Prefill `prompt` once and keep its KV for later requests to import; returns its length
    (`Engine.prepare_prefix`)."""
    if not eng.store.supports_prefix:
        raise ValueError(f"prefix KV export (prepare_prefix) is not available for {type(eng.store).__name__}")
    ids = eng.encode_prompt(prompt)
    stored = eng.prefixes.get(ids)
    if stored is not None and (eng.spec is None or eng.spec.serves(stored)):
        return len(ids)
    rid = eng.add_request(ids, SamplingParams(max_tokens=1), export_prefix=True)
    while rid in eng.requests:
        eng._held_outputs.extend(eng.step())  # other requests' outputs wait for the next step()
    return len(ids)


def prefix_match(eng: Engine, request_id: str) -> tuple:
    """(stored prefix or None, rows to import) for a waiting request, matched once. A prefix
    without the features this engine's drafter reads is not imported (the prompt is prefilled)."""
    m = eng._matches.get(request_id)
    if m is None and eng.requests[request_id].params.prompt_logprobs is not None:
        m = eng._matches[request_id] = (None, 0)  # prompt logprobs need every prompt position's logits
    if m is None:
        m = eng.prefixes.match(eng.requests[request_id].prompt_ids)
        if m[0] is not None and eng.spec is not None and not eng.spec.serves(m[0]):
            m = (None, 0)
        eng._matches[request_id] = m
    return m


def store_export(eng: Engine, req: Request) -> tuple[dict, object | None]:
    """(the drafter's kept features of req's prompt, the store's own export of it or None): a
    store with its own prefix item (DeepSeek-V4's streaming state) exports it here."""
    feats = (eng.spec.take_features(req.request_id) if eng.spec is not None else None) or {}
    return feats, eng.store.export_prefix(req.request_id, req.prompt_ids, feats, eng.prefixes.pin)


def export(eng: Engine, req: Request) -> None:
    """Keep req's prompt KV as a prefix: the store's own item (`export_prefix`, DeepSeek-V4's
    streaming state), else its rows by position (`read_rows`) as a `StoredPrefix`."""
    feats, own = store_export(eng, req)
    if own is not None:
        eng.prefixes.put(own)
    else:
        latent, index = eng.store.read_rows(req.request_id, len(req.prompt_ids), eng.prefixes.pin)
        item = eng.prefixes.add(req.prompt_ids, latent, index, feats)
        layout = eng.store.prefix_layout()
        if layout is not None:  # its page layout now, not on the first import
            item.paged(*layout)
    finish(eng, req, "prefix")
