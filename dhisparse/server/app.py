"""The FastAPI application: OpenAI-compatible routes over an `EngineWorker`.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream over SSE with
`"stream": true`), GET /v1/models, GET /health, GET /metrics, POST /tokenize (vLLM's shape:
{"prompt"} -> {"tokens", "count", "max_model_len"}), and the dhisparse extension
POST /v1/dhisparse/prefix (prefill a prompt once; later prompts starting with it import its KV).

Every request passes `RequestGuard` (guard.py: Host, API key, body size) first; CORS is added only
with `allowed_origins`. JSON routes demand `Content-Type: application/json` (415 otherwise, so a
cross-origin `text/plain` form post never runs), parse their body with the strict models of
protocol/ (declared in /openapi.json), and tokenize, apply the chat template and validate on a
worker thread - never on the event loop nor the engine thread - before the worker gets token ids.
Every error, FastAPI's own 404 / 405 / 422 included, is an OpenAI-shaped JSON object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from dhisparse.engine.grammar import GrammarError
from dhisparse.engine.progress import ServingLog
from dhisparse.server import protocol as P
from dhisparse.server.chat import chat_setup
from dhisparse.server.guard import RequestGuard
from dhisparse.server.metrics import ServerMetrics
from dhisparse.server.responses import Formatter, Sub
from dhisparse.server.tools import PARSER_NAMES, choose_format
from dhisparse.server.streaming import AbortingStreamingResponse, StreamContext, collect, next_event, stream_events
from dhisparse.server.worker import EngineWorker

SHUTDOWN_MODES = ("drain", "abort")
PARSE_INLINE_BYTES = 64 << 10  # smaller bodies are parsed on the event loop (well under a millisecond)
PREFIX_CHARS_PER_TOKEN = 8  # _too_long: prefix characters read per token of the limit
_ORIGIN = re.compile(r"^https?://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d{1,5})?$")
_HOST = re.compile(r"^(\*|(\*\.)?[A-Za-z0-9_.-]+|\[[0-9a-fA-F:.]+\]|[0-9a-fA-F:.]+)$")


@dataclass(frozen=True)
class ServerConfig:
    """Server settings (CLI flags of `dhisparse serve` in brackets).

    served_model_name [--served-model-name]: the `model` clients must send; None = the model path.
    default_max_tokens [--default-max-tokens]: output cap when a request sets no max_tokens; None
        (the default) = up to the context (max_model_len - prompt length, as vLLM). A request's
        unset max_tokens is clamped to the context either way, never a 400.
    shutdown_mode [--shutdown-mode]: on SIGTERM, "drain" lets in-flight requests finish (up to
        drain_timeout_s), "abort" ends them at once (finish_reason "abort").
    drain_timeout_s [--drain-timeout]: longest wait for in-flight requests at shutdown; then every
        stream ends with an abort chunk and [DONE], every other request with a JSON 503.
    request_timeout_s [--request-timeout]: a request running longer is aborted (HTTP 504).
    host [--host]: the address the server is bound to; Host headers naming it are accepted.
    api_key [--api-key, env DHISPARSE_API_KEY]: when set, every route but /health needs
        `Authorization: Bearer <api_key>`.
    allowed_hosts [--allowed-hosts]: Host names accepted besides localhost / 127.0.0.1 / ::1 /
        `host` ("*" = any, "*.example.com" = its subdomains).
    allowed_origins [--allowed-origins]: CORS origins (scheme://host[:port], "*" = any); empty = no CORS.
    max_request_bytes [--max-request-bytes]: largest request body (413 beyond it).
    stream_stall_timeout_s [--stream-stall-timeout]: a response whose client acknowledges none of
        the bytes waiting for it this long is aborted (its KV pages are freed).
    header_timeout_s [--header-timeout]: a connection must send a request's headers within this.
    log_interval_s [--log-interval]: seconds between serving log lines (gen / prefill tok/s, queue,
        pools; engine/progress.py) while there is work; 0 = off.
    tool_call_parser [--tool-call-parser]: the models' tool-call format (server/tools: glm47, glm45,
        deepseekv31, deepseekv32, deepseekv4); None / "auto" = what the chat template writes, else
        the architecture's.
    """

    served_model_name: str | None = None
    default_max_tokens: int | None = None
    shutdown_mode: str = "drain"
    drain_timeout_s: float = 30.0
    request_timeout_s: float = 3600.0
    host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = 4 << 20
    stream_stall_timeout_s: float = 60.0
    header_timeout_s: float = 10.0
    log_interval_s: float = 0.0
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.shutdown_mode not in SHUTDOWN_MODES:
            raise ValueError(f"shutdown_mode must be one of {SHUTDOWN_MODES}; got {self.shutdown_mode!r}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1; got {self.default_max_tokens}")
        if not (self.drain_timeout_s >= 0 and self.request_timeout_s > 0):
            raise ValueError("drain_timeout_s must be >= 0 and request_timeout_s > 0")
        if self.tool_call_parser not in (None,) + PARSER_NAMES:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSER_NAMES)}; got {self.tool_call_parser!r}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        self._check_security()

    def _check_security(self) -> None:
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or any(c.isspace() or not c.isprintable() for c in key)):
            raise ValueError("--api-key (api_key) must be a non-empty string without spaces or control characters")
        for h in self.allowed_hosts:
            if not isinstance(h, str) or not _HOST.match(h):
                raise ValueError(f"--allowed-hosts (allowed_hosts): {P.quote(h)} is not a host name; give names like "
                                 "'api.example.com', '*.example.com', an IP, or '*', comma-separated, without scheme or port")
        for o in self.allowed_origins:
            if not isinstance(o, str) or not (o == "*" or _ORIGIN.match(o)):
                raise ValueError(f"--allowed-origins (allowed_origins): {P.quote(o)} is not an origin; give "
                                 "scheme://host[:port] (e.g. https://app.example.com) or '*', comma-separated")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes (max_request_bytes) must be a whole number of bytes >= 1; "
                             f"got {P.quote(self.max_request_bytes)}")
        for flag, name in (("--stream-stall-timeout", "stream_stall_timeout_s"), ("--header-timeout", "header_timeout_s")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{flag} ({name}) must be a finite number of seconds > 0; got {P.quote(v)}")


class ServerState:
    """What the routes share: engine worker, metrics, settings, and whether new work is accepted."""

    def __init__(self, engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.model_name = config.served_model_name or engine.config.model
        self.metrics = ServerMetrics(lambda: self.worker.stats, self.model_name, engine.config.preset,
                                     slots_total=engine.config.max_running_requests)
        serving_log = ServingLog(config.log_interval_s, emit=print) if config.log_interval_s > 0 else None
        self.worker = EngineWorker(engine, on_finish=self.metrics.observe_finished, on_stats=serving_log)
        self.tool_format = choose_format(config.tool_call_parser, engine.model_config.architecture,
                                         engine.tokenizer.chat_template)
        self.accepting = True
        self.inflight = 0  # HTTP requests being answered (RequestGuard counts them)
        self.created = int(time.time())

    def begin_shutdown(self) -> None:
        """Stop accepting work; in abort mode end every in-flight request now."""
        self.accepting = False
        if self.config.shutdown_mode == "abort":
            self.worker.abort_all()

    def abort(self, request_id: str, reason: str) -> None:
        """Abort one engine request on behalf of its handler (the client left, a timeout, a stall)."""
        self.metrics.observe_aborted(reason)
        self.worker.abort(request_id)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.inflight == 0

    def check_ready(self) -> None:
        if not self.accepting:
            raise P.ApiError("the server is shutting down; retry on another replica", status=503,
                             type_="server_error", code="shutting_down")
        if not self.worker.alive:
            raise P.ApiError(self.worker.error or "the engine thread is not running", status=503,
                             type_="server_error", code="engine_dead")


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
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _describe_bodies(app)
    app.add_middleware(RequestGuard, state=state, bind_host=config.host, allowed_hosts=config.allowed_hosts,
                       api_key=config.api_key, max_request_bytes=config.max_request_bytes)
    if config.allowed_origins:  # outermost, so preflights are answered before the API-key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_credentials=False,
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["authorization", "content-type"])
    return app


def error_response(exc: P.ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(P.ApiError)
    async def _api_error(request: Request, exc: P.ApiError) -> JSONResponse:
        state.metrics.observe_rejected(exc.status)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{exc.detail}: {request.method} {P.quote(request.url.path)}"
        return await _api_error(request, P.ApiError(msg, status=exc.status_code, code=code,
                                                    headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [dict(e, loc=tuple(e["loc"])[1:] if e["loc"] and e["loc"][0] == "body" else tuple(e["loc"]))
                  for e in exc.errors()]
        return await _api_error(request, P.described(errors) if errors else P.ApiError("invalid request"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:  # logged by uvicorn
        return JSONResponse(P.ApiError("internal server error", status=500, type_="server_error",
                                       code="internal_error").body(), status_code=500)


def _describe_bodies(app: FastAPI) -> None:
    """/openapi.json: the request models under components/schemas (routes point at them)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in P.REQUEST_MODELS],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _body(model: type) -> dict:
    """`openapi_extra` of a route whose JSON body is `model` (parsed by `read_json`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def read_json(request: Request, model: type[P.M]) -> P.M:
    """The body as `model`: 415 unless it is sent as application/json, 400 for anything malformed."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise P.ApiError("send the body as JSON with 'Content-Type: application/json'", status=415,
                         code="unsupported_media_type")
    raw = await request.body()
    if len(raw) <= PARSE_INLINE_BYTES:
        return P.parse_body(raw, model)
    return await asyncio.to_thread(P.parse_body, raw, model)


def _too_long(engine, text: str, max_tokens: int) -> str | None:
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


def _prompt_ids(engine, prompt: str | list[int], params, param: str) -> list[int]:
    """Tokenize and validate (worker thread): ValueError -> 400 naming `param`."""
    try:
        if isinstance(prompt, str) and (err := _too_long(engine, prompt, params.max_tokens if params else 1)):
            raise P.ApiError(err, param=param)
        ids = engine.encode_prompt(prompt)
        if params is not None:
            engine.validate(ids, params)
        return ids
    except ValueError as e:
        raise P.ApiError(str(e), param=param) from None


def _prepare(engine, prompt: str | list[int], params, given: bool, default: int | None, param: str):
    """Tokenize, fit an unset max_tokens to the context, validate (worker thread) -> (ids, params)."""
    try:
        if isinstance(prompt, str) and (err := _too_long(engine, prompt, params.max_tokens)):
            raise P.ApiError(err, param=param)
        ids = engine.encode_prompt(prompt)
        params = P.fit_max_tokens(params, len(ids), engine.max_model_len, given, default, engine.model_config.vocab_size)
        if params.grammar is not None:
            _check_grammar(engine, params.grammar)
        engine.validate(ids, params)
        return ids, params
    except ValueError as e:
        raise P.ApiError(str(e), param=param) from None


def _check_grammar(engine, grammar: str) -> None:
    try:
        engine.grammars.validate(grammar)
    except GrammarError as e:
        raise P.ApiError(str(e), param="response_format") from None


def _chat_text(engine, setup) -> str:
    try:
        return setup.render(engine.tokenizer)
    except Exception as e:  # noqa: BLE001 - a template raising on a client's messages is the client's 400
        raise P.ApiError(f"chat template failed: {type(e).__name__}: {e}", param="messages") from None


def _tool_params(engine, setup, params):
    """The params with what reading tool calls needs (worker thread: building a grammar's tokenizer
    the first time takes a while)."""
    try:
        params = setup.sampling(params, engine.grammars.literal)
        if setup.choice.constrained:
            engine.grammars.validate(params.grammar)
        return params
    except GrammarError as e:
        raise P.ApiError(f"tools: {e}", param="tools") from None


def _model_card(state: "ServerState") -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "dhisparse",
            "max_model_len": state.engine.max_model_len, "preset": state.engine.config.preset}


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.accepting and state.worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": state.model_name,
                "preset": state.engine.config.preset, "error": state.worker.error}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != state.model_name:
            raise P.ApiError(f"model {P.quote(model_id)} is not served here; see /v1/models", param="model",
                             status=404, code="model_not_found")
        return _model_card(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/v1/completions", openapi_extra=_body(P.CompletionRequest))
    async def completions(request: Request):
        state.check_ready()
        body = await read_json(request, P.CompletionRequest)
        P.check_model(body.model, state.model_name)
        params = P.sampling_params(body, body.max_tokens, state.config.default_max_tokens)
        prompts = P.completion_prompts(body)
        given = body.max_tokens is not None
        prepared = await asyncio.to_thread(
            lambda: [_prepare(engine, p, params, given, state.config.default_max_tokens, "prompt") for p in prompts])
        texts = [p if isinstance(p, str) else engine.tokenizer.decode(ids) for p, (ids, _) in zip(prompts, prepared)] \
            if body.echo else ()
        fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", state.model_name, chat=False, tokenizer=engine.tokenizer,
                        prompt_texts=texts)
        n = body.n or 1
        subs = _subs(fmt.request_id, prepared, n, body.best_of or n, body.logprobs is not None,
                     echo=body.echo, echo_only=body.echo and body.max_tokens == 0)
        return await _generate(request, state, subs, fmt, body, "prompt", n)

    @app.post("/v1/chat/completions", openapi_extra=_body(P.ChatRequest))
    async def chat(request: Request):
        state.check_ready()
        body = await read_json(request, P.ChatRequest)
        P.check_model(body.model, state.model_name)
        given = body.max_completion_tokens is not None
        cap = body.max_completion_tokens if given else body.max_tokens
        params = P.sampling_params(body, cap, state.config.default_max_tokens,
                                   "max_completion_tokens" if given else "max_tokens")
        setup = chat_setup(body, state.tool_format, engine.tokenizer.chat_template is None)
        params = await asyncio.to_thread(_tool_params, engine, setup, params)
        prepared = await asyncio.to_thread(lambda: _prepare(engine, _chat_text(engine, setup), params,
                                                            cap is not None, state.config.default_max_tokens, "messages"))
        fmt = Formatter(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, chat=True, tokenizer=engine.tokenizer,
                        tools=setup.reading)
        n = body.n or 1
        return await _generate(request, state, _subs(fmt.request_id, [prepared], n, n, bool(body.logprobs)),
                               fmt, body, "messages", n)

    @app.post("/tokenize", openapi_extra=_body(P.TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        body = await read_json(request, P.TokenizeRequest)
        P.check_model(body.model, state.model_name)
        ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/v1/dhisparse/prefix", openapi_extra=_body(P.PrefixRequest))
    async def prefix(request: Request) -> dict:
        state.check_ready()
        body = await read_json(request, P.PrefixRequest)
        P.check_model(body.model, state.model_name)
        ids = await asyncio.to_thread(_prompt_ids, engine, body.prompt, None, "prompt")
        rid = f"prefix-{uuid.uuid4().hex}"
        q = state.worker.prepare_prefix(rid, ids)
        while True:
            ev = await next_event(q, state, rid)
            if ev.kind == "error":
                raise P.ApiError(ev.payload, param="prompt")
            if ev.kind == "done":
                return {"object": "dhisparse.prefix", "prefix_tokens": ev.payload}


def _subs(rid: str, prepared: list, n: int, best_of: int, report: bool, echo: bool = False,
          echo_only: bool = False) -> list[Sub]:
    """best_of engine requests per prompt (n of them are returned); request i of a prompt uses
    seed + i (P.seeded). best_of > n ranks by cumulative logprob, so logprobs are computed."""
    subs = []
    for pi, (ids, params) in enumerate(prepared):
        if best_of > n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)
        for j in range(best_of):
            subs.append(Sub(pi * best_of + j, f"{rid}-{pi}-{j}", ids, P.seeded(params, j), pi, echo, echo_only, report))
    return subs


class _Connected:
    """Stands in for the request in all but one of an HTTP request's `collect`s: one poller of
    the client's disconnect is enough (they are all cancelled together)."""

    scope: dict = {}

    async def is_disconnected(self) -> bool:
        return False


async def _generate(request: Request, state: ServerState, subs: list[Sub], fmt: Formatter, body: P.CommonRequest,
                    param: str, n: int = 1):
    """Submit the engine requests; a rejection is a 400 (the others are aborted); then stream or
    collect their outputs (best_of > n: the n with the highest cumulative logprob per prompt)."""
    qs: list[tuple[Sub, asyncio.Queue]] = []
    try:
        for sub in subs:
            qs.append((sub, state.worker.submit(sub.request_id, sub.prompt_ids, sub.params)))
        for sub, q in qs:
            ev = await next_event(q, state, sub.request_id)
            if ev.kind == "error":
                raise P.ApiError(ev.payload, param=param)
    except BaseException:
        for sub, _ in qs:
            state.worker.abort(sub.request_id)
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        ctx = StreamContext()
        gen = stream_events(qs, state, fmt, include_usage, ctx)
        return AbortingStreamingResponse(gen, ctx, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    lps: list[list] = [[] for _ in qs]
    tasks = [asyncio.ensure_future(collect(request if k == 0 else _Connected(), q, state, sub.request_id, lps[k]))
             for k, (sub, q) in enumerate(qs)]
    try:
        outs = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    picked = _best(subs, outs, lps, n)
    return JSONResponse(fmt.response([outs[k] for k in picked], [subs[k] for k in picked],
                                     all_logprobs=[lps[k] for k in picked]))


def _best(subs: list[Sub], outs: list, lps: list[list], n: int) -> list[int]:
    """Positions of the choices to return: every one, or per prompt the n of highest cumulative
    logprob (ties by order), re-indexed prompt * n + rank."""
    per = len(subs) // (max(s.prompt_index for s in subs) + 1)
    if per == n:
        return list(range(len(subs)))
    picked = []
    for pi in range(len(subs) // per):
        ks = sorted(range(pi * per, (pi + 1) * per), key=lambda k: -sum(lp.logprob for lp in lps[k]))[:n]
        for rank, k in enumerate(ks):
            subs[k] = dataclasses.replace(subs[k], index=pi * n + rank)
        picked += ks
    return picked
