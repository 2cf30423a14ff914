"""Token-level routes: POST /tokenize (vLLM's shape: {"prompt"} -> {"tokens", "count",
"max_model_len"}) and the dhisparse extension POST /v1/dhisparse/prefix (prefill a prompt once;
later prompts starting with it import its KV)."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.protocol.tokens import PrefixRequest, TokenizeRequest
from dhisparse.server.routes.prepare import body_schema, prompt_ids, read_body
from dhisparse.server.state import ServerState
from dhisparse.server.streaming import next_event


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    """POST /tokenize and POST /v1/dhisparse/prefix."""
    engine = state.engine

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        body = await read_body(request, state, TokenizeRequest, ready=False)
        ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/v1/dhisparse/prefix", openapi_extra=body_schema(PrefixRequest))
    async def prefix(request: Request) -> dict:
        body = await read_body(request, state, PrefixRequest)
        ids = await asyncio.to_thread(prompt_ids, engine, body.prompt, None, "prompt")
        rid = f"prefix-{uuid.uuid4().hex}"
        q = state.worker.prepare_prefix(rid, ids)
        while True:
            ev = await next_event(q, state, rid)
            if ev.kind == "error":
                raise ApiError(ev.payload, param="prompt")
            if ev.kind == "done":
                return {"object": "dhisparse.prefix", "prefix_tokens": ev.payload}
