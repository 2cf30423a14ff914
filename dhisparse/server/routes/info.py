"""Routes that describe the server: GET /health (200 or 503 with the engine's error), GET
/v1/models and /v1/models/{id} (the one served model's card), GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from dhisparse.server.protocol.errors import ApiError, quote
from dhisparse.server.state import ServerState


def model_card(state: ServerState) -> dict:
    """The served model as /v1/models lists it."""
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dhisparse",
            "max_model_len": state.engine.max_model_len, "preset": state.engine.config.preset}


def add_info_routes(app: FastAPI, state: ServerState) -> None:
    """GET /health, /v1/models, /v1/models/{model_id}, /metrics."""

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.accepting and state.worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": state.model_name,
                "preset": state.engine.config.preset, "error": state.worker.error}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != state.model_name:
            raise ApiError(f"model {quote(model_id)} is not served here; see /v1/models", param="model",
                           status=404, code="model_not_found")
        return model_card(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
