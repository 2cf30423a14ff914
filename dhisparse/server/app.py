"""The FastAPI application: OpenAI-compatible routes over an `EngineWorker`.

Routes (`routes/`): POST /v1/completions, POST /v1/chat/completions (both stream over SSE with
`"stream": true`), GET /v1/models, GET /health, GET /metrics, POST /tokenize (vLLM's shape:
{"prompt"} -> {"tokens", "count", "max_model_len"}), and the dhisparse extension
POST /v1/dhisparse/prefix (prefill a prompt once; later prompts starting with it import its KV).

Every request passes `RequestGuard` (guard.py: Host, API key, body size) first; CORS is added only
with `allowed_origins`. JSON routes demand `Content-Type: application/json` (415 otherwise, so a
cross-origin `text/plain` form post never runs), parse their body with the strict models of
protocol/ (declared in /openapi.json), and tokenize, apply the chat template and validate on a
worker thread - never on the event loop nor the engine thread - before the worker gets token ids
(routes/prepare.py). Every error, FastAPI's own 404 / 405 / 422 included, is an OpenAI-shaped
JSON object. Settings are `ServerConfig` (config.py), what the routes share `ServerState` (state.py).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from dhisparse.server.config import ServerConfig
from dhisparse.server.guard import RequestGuard
from dhisparse.server.protocol import REQUEST_MODELS
from dhisparse.server.protocol.body import described
from dhisparse.server.protocol.errors import ApiError, quote
from dhisparse.server.routes.chat import add_chat_routes
from dhisparse.server.routes.completions import add_completion_routes
from dhisparse.server.routes.info import add_info_routes
from dhisparse.server.routes.tokens import add_token_routes
from dhisparse.server.state import ServerState

__all__ = ["ServerConfig", "ServerState", "create_app", "error_response"]


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """Build the app; its lifespan starts the engine thread and stops it (aborting leftovers)."""
    config = config or ServerConfig()
    state = ServerState(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        state.accepting = False
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="dhisparse", lifespan=lifespan)
    app.state.dhisparse = state
    _add_error_handlers(app, state)
    add_info_routes(app, state)
    add_completion_routes(app, state)
    add_chat_routes(app, state)
    add_token_routes(app, state)
    _describe_bodies(app)
    app.add_middleware(RequestGuard, state=state, bind_host=config.host, allowed_hosts=config.allowed_hosts,
                       api_key=config.api_key, max_request_bytes=config.max_request_bytes)
    if config.allowed_origins:  # outermost, so preflights are answered before the API-key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_credentials=False,
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["authorization", "content-type"])
    return app


def error_response(exc: ApiError) -> JSONResponse:
    """`exc` as its JSON response (status and headers)."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        state.metrics.observe_rejected(exc.status)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{exc.detail}: {request.method} {quote(request.url.path)}"
        return await _api_error(request, ApiError(msg, status=exc.status_code, code=code,
                                                  headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [dict(e, loc=tuple(e["loc"])[1:] if e["loc"] and e["loc"][0] == "body" else tuple(e["loc"]))
                  for e in exc.errors()]
        return await _api_error(request, described(errors) if errors else ApiError("invalid request"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn
        return JSONResponse(ApiError("internal server error", status=500, type_="server_error",
                                     code="internal_error").body(), status_code=500)


def _describe_bodies(app: FastAPI) -> None:
    """/openapi.json: the request models under components/schemas (routes point at them)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
