"""POST /v1/chat/completions: the messages through the chat template (server/chat.py: template
input, tools and tool_choice), n choices, logprobs; streamed over SSE with `"stream": true`.
Rendering the template and building a tool grammar run on a worker thread."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, Request

from dhisparse.engine.grammar import GrammarError
from dhisparse.server.chat import chat_setup
from dhisparse.server.protocol.chat import ChatRequest
from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.protocol.sampling import sampling_params
from dhisparse.server.responses import Formatter
from dhisparse.server.routes.generate import generate, make_subs
from dhisparse.server.routes.prepare import body_schema, prepare, read_body
from dhisparse.server.state import ServerState


def _chat_text(engine, setup) -> str:
    try:
        return setup.render(engine.tokenizer)
    except Exception as e:  # noqa: BLE001 - a template raising on a client's messages is the client's 400
        raise ApiError(f"chat template failed: {type(e).__name__}: {e}", param="messages") from None


def _tool_params(engine, setup, params):
    """The params with what reading tool calls needs (worker thread: building a grammar's tokenizer
    the first time takes a while)."""
    try:
        params = setup.sampling(params, engine.grammars.literal)
        if setup.choice.constrained:
            engine.grammars.validate(params.grammar)
        return params
    except GrammarError as e:
        raise ApiError(f"tools: {e}", param="tools") from None


def add_chat_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/chat/completions."""

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest))
    async def chat(request: Request):
        engine = state.engine
        body = await read_body(request, state, ChatRequest)
        given = body.max_completion_tokens is not None
        cap = body.max_completion_tokens if given else body.max_tokens
        params = sampling_params(body, cap, state.config.default_max_tokens,
                                 "max_completion_tokens" if given else "max_tokens")
        setup = chat_setup(body, state.tool_format, engine.tokenizer.chat_template is None)
        params = await asyncio.to_thread(_tool_params, engine, setup, params)
        prepared = await asyncio.to_thread(lambda: prepare(engine, _chat_text(engine, setup), params,
                                                           cap is not None, state.config.default_max_tokens, "messages"))
        fmt = Formatter(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, chat=True, tokenizer=engine.tokenizer,
                        tools=setup.reading)
        n = body.n or 1
        return await generate(request, state, make_subs(fmt.request_id, [prepared], n, n, bool(body.logprobs)),
                              fmt, body, "messages", n)
