"""POST /v1/completions: text or token-id prompts (one or a batch), n choices each from best_of
engine requests, echo and logprobs; streamed over SSE with `"stream": true`."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from dhisparse.server.protocol.completions import CompletionRequest, completion_prompts
from dhisparse.server.protocol.sampling import sampling_params
from dhisparse.server.responses import Formatter
from dhisparse.server.routes.generate import generate, make_subs
from dhisparse.server.routes.prepare import body_schema, prepare, read_body
from dhisparse.server.state import ServerState


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions."""
    engine = state.engine

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        body = await read_body(request, state, CompletionRequest)
        params = sampling_params(body, body.max_tokens, state.config.default_max_tokens)
        prompts = completion_prompts(body)
        given = body.max_tokens is not None
        prepared = await asyncio.to_thread(
            lambda: [prepare(engine, p, params, given, state.config.default_max_tokens, "prompt") for p in prompts])
        texts = [p if isinstance(p, str) else engine.tokenizer.decode(ids) for p, (ids, _) in zip(prompts, prepared)] \
            if body.echo else ()
        fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", state.model_name, chat=False, tokenizer=engine.tokenizer,
                        prompt_texts=texts)
        n = body.n or 1
        subs = make_subs(fmt.request_id, prepared, n, body.best_of or n, body.logprobs is not None,
                         echo=body.echo, echo_only=body.echo and body.max_tokens == 0)
        return await generate(request, state, subs, fmt, body, "prompt", n)
