"""The FastAPI application: OpenAI-compatible routes over an `EngineWorker`.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream over SSE with
`"stream": true`), GET /v1/models, GET /health, GET /metrics, POST /tokenize (vLLM's shape:
{"prompt"} -> {"tokens", "count", "max_model_len"}), and the dhisparse extension
POST /v1/dhisparse/prefix (prefill a prompt once; later prompts starting with it import its KV).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dhisparse.server import protocol as P
from dhisparse.server.metrics import ServerMetrics
from dhisparse.server.responses import Formatter
from dhisparse.server.streaming import AbortingStreamingResponse, collect, next_event, stream_events
from dhisparse.server.worker import EngineWorker

SHUTDOWN_MODES = ("drain", "abort")


@dataclass(frozen=True)
class ServerConfig:
    """Server settings (CLI flags of `dhisparse serve` in brackets).

    served_model_name [--served-model-name]: the `model` clients must send; None = the model path.
    default_max_tokens [--default-max-tokens]: output cap when a request sets no max_tokens.
    shutdown_mode [--shutdown-mode]: on SIGTERM, "drain" lets in-flight requests finish (up to
        drain_timeout_s), "abort" ends them at once (finish_reason "abort").
    drain_timeout_s [--drain-timeout]: longest wait for in-flight requests at shutdown.
    request_timeout_s [--request-timeout]: a request running longer is aborted (HTTP 504).
    """

    served_model_name: str | None = None
    default_max_tokens: int = 256
    shutdown_mode: str = "drain"
    drain_timeout_s: float = 30.0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.shutdown_mode not in SHUTDOWN_MODES:
            raise ValueError(f"shutdown_mode must be one of {SHUTDOWN_MODES}; got {self.shutdown_mode!r}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1; got {self.default_max_tokens}")
        if self.drain_timeout_s < 0 or self.request_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be >= 0 and request_timeout_s > 0")


class ServerState:
    """What the routes share: engine worker, metrics, settings, and whether new work is accepted."""

    def __init__(self, engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.model_name = config.served_model_name or engine.config.model
        self.metrics = ServerMetrics(lambda: self.worker.stats, self.model_name, engine.config.preset)
        self.worker = EngineWorker(engine, on_finish=self.metrics.observe_finished)
        self.accepting = True
        self.created = int(time.time())

    def begin_shutdown(self) -> None:
        """Stop accepting work; in abort mode end every in-flight request now."""
        self.accepting = False
        if self.config.shutdown_mode == "abort":
            self.worker.abort_all()

    def check_ready(self) -> None:
        if not self.accepting:
            raise P.ApiError("the server is shutting down; retry on another replica", status=503,
                             type_="server_error", code="shutting_down")
        if not self.worker.alive:
            raise P.ApiError(self.worker.error or "the engine thread is not running", status=503,
                             type_="server_error", code="engine_dead")


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """Build the app; its lifespan starts the engine thread and stops it (aborting leftovers)."""
    state = ServerState(engine, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        state.accepting = False
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="dhisparse", lifespan=lifespan)
    app.state.dhisparse = state

    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, exc: P.ApiError) -> JSONResponse:
        state.metrics.observe_rejected(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.accepting and state.worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": state.model_name,
                "preset": state.engine.config.preset, "error": state.worker.error}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dhisparse",
                "max_model_len": state.engine.max_model_len, "preset": state.engine.config.preset}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_ready()
        body = P.parse_body(await request.body(), P.CompletionRequest)
        P.check_model(body.model, state.model_name)
        params = P.sampling_params(body, body.max_tokens, state.config.default_max_tokens)
        fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", state.model_name, chat=False)
        return await _generate(request, state, P.completion_prompt(body), params, fmt, body, "prompt")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        state.check_ready()
        body = P.parse_body(await request.body(), P.ChatRequest)
        P.check_model(body.model, state.model_name)
        cap = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = P.sampling_params(body, cap, state.config.default_max_tokens)
        try:
            prompt = state.engine.tokenizer.apply_chat_template(P.chat_messages(body))
        except ValueError as e:
            raise P.ApiError(f"chat template failed: {e}", param="messages") from None
        fmt = Formatter(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, chat=True)
        return await _generate(request, state, prompt, params, fmt, body, "messages")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = P.parse_body(await request.body(), P.TokenizeRequest)
        P.check_model(body.model, state.model_name)
        ids = await asyncio.to_thread(state.engine.tokenizer.encode, body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/v1/dhisparse/prefix")
    async def prefix(request: Request) -> dict:
        state.check_ready()
        body = P.parse_body(await request.body(), P.PrefixRequest)
        P.check_model(body.model, state.model_name)
        rid = f"prefix-{uuid.uuid4().hex}"
        q = state.worker.prepare_prefix(rid, body.prompt)
        while True:
            ev = await next_event(q, state, rid)
            if ev.kind == "error":
                raise P.ApiError(ev.payload, param="prompt")
            if ev.kind == "done":
                return {"object": "dhisparse.prefix", "prefix_tokens": ev.payload}


async def _generate(request: Request, state: ServerState, prompt, params, fmt: Formatter,
                    body: P._Common, param: str):
    """Submit to the engine; a rejection is a 400; then stream or collect the outputs."""
    q = state.worker.submit(fmt.request_id, prompt, params)
    ev = await next_event(q, state, fmt.request_id)
    if ev.kind == "error":
        raise P.ApiError(ev.payload, param=param)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = stream_events(q, state, fmt, include_usage)
        return AbortingStreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = await collect(request, q, state, fmt.request_id)
    return JSONResponse(fmt.response(out))
