"""A route's input: its JSON body (`read_body` / `read_json`: 503 while not taking work, 415 unless
sent as application/json, 400 for anything malformed or another model; its /openapi.json
reference `body_schema`), and the prompt tokenized, fitted to the context and
validated on a worker thread - never on the event loop nor the engine thread - so the worker
gets token ids. A ValueError of the engine's checks becomes a 400 naming the request's field."""

from __future__ import annotations

import asyncio

from fastapi import Request

from dhisparse.engine.grammar import GrammarError
from dhisparse.server.protocol.body import M, parse_body
from dhisparse.server.protocol.common import check_model
from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.protocol.sampling import fit_max_tokens
from dhisparse.server.state import ServerState

PARSE_INLINE_BYTES = 64 << 10  # smaller bodies are parsed on the event loop (well under a millisecond)
PREFIX_CHARS_PER_TOKEN = 8  # too_long: prefix characters read per token of the limit


def body_schema(model: type) -> dict:
    """`openapi_extra` of a route whose JSON body is `model` (parsed by `read_json`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def read_json(request: Request, model: type[M]) -> M:
    """The body as `model`: 415 unless it is sent as application/json, 400 for anything malformed."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError("send the body as JSON with 'Content-Type: application/json'", status=415,
                       code="unsupported_media_type")
    raw = await request.body()
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_body(raw, model)
    return await asyncio.to_thread(parse_body, raw, model)


async def read_body(request: Request, state: ServerState, model: type[M], ready: bool = True) -> M:
    """A route's body: 503 unless the server takes work (when `ready`: routes that use the engine),
    then `read_json`, then a 400 unless it names the served model (or none)."""
    if ready:
        state.check_ready()
    body = await read_json(request, model)
    check_model(body.model, state.model_name)
    return body


def too_long(engine, text: str, max_tokens: int) -> str | None:
    """A text prompt far over max_model_len is refused from the tokens of a prefix, without
    tokenizing all of it: tokenizing holds the GIL, and the engine thread stalls meanwhile (a
    4 MB prompt stopped every stream for 0.2 s). The prefix must give twice the limit, so a last
    word cut at the prefix's end cannot turn a prompt that fits into a refusal."""
    limit = engine.max_model_len
    chars = PREFIX_CHARS_PER_TOKEN * (2 * limit + 64)
    if len(text) <= chars:
        return None
    n = len(engine.tokenizer.encode(text[:chars]))
    if n <= 2 * limit + 64:
        return None
    return (f"the prompt has more than {n} tokens (its first {chars} characters alone) and max_tokens is "
            f"{max_tokens}: more than max_model_len {limit}; shorten the prompt or lower max_tokens")


def prompt_ids(engine, prompt: str | list[int], params, param: str) -> list[int]:
    """Tokenize and validate (worker thread): ValueError -> 400 naming `param`."""
    try:
        if isinstance(prompt, str) and (err := too_long(engine, prompt, params.max_tokens if params else 1)):
            raise ApiError(err, param=param)
        ids = engine.encode_prompt(prompt)
        if params is not None:
            engine.validate(ids, params)
        return ids
    except ValueError as e:
        raise ApiError(str(e), param=param) from None


def prepare(engine, prompt: str | list[int], params, given: bool, default: int | None, param: str):
    """Tokenize, fit an unset max_tokens to the context, validate (worker thread) -> (ids, params)."""
    try:
        if isinstance(prompt, str) and (err := too_long(engine, prompt, params.max_tokens)):
            raise ApiError(err, param=param)
        ids = engine.encode_prompt(prompt)
        params = fit_max_tokens(params, len(ids), engine.max_model_len, given, default, engine.model_config.vocab_size)
        if params.grammar is not None:
            _check_grammar(engine, params.grammar)
        engine.validate(ids, params)
        return ids, params
    except ValueError as e:
        raise ApiError(str(e), param=param) from None


def _check_grammar(engine, grammar: str) -> None:
    try:
        engine.grammars.validate(grammar)
    except GrammarError as e:
        raise ApiError(str(e), param="response_format") from None
