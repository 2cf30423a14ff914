"""`dhisparse serve`: the OpenAI-compatible HTTP server (see dhisparse.server)."""

from __future__ import annotations

import argparse
import errno
import os
import socket

from dhisparse.cli.args import HelpFormatter, add_engine_args, build_engine, engine_config

TOOL_CALL_PARSERS = ("auto", "glm47", "glm45", "deepseekv31", "deepseekv32", "deepseekv4")  # server/tools/parser.py
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       formatter_class=HelpFormatter,
                       description="OpenAI-compatible server: /v1/completions, /v1/chat/completions (SSE with "
                                   "stream=true), /v1/models, /health, /metrics (Prometheus).")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)")
    g.add_argument("--port", type=int, default=30000, help="TCP port")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the --model-path value)")
    g.add_argument("--default-max-tokens", type=int, default=None,
                   help="output cap for requests without max_tokens (default: up to the context, as vLLM)")
    g.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between serving log lines (throughput, queue, pools) while there is work; 0 = off")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                   help="the model's tool-call format, read into tool_calls (auto: what the chat template writes, "
                        "else the architecture's: GLM-5 glm47, DeepSeek-V3.2 deepseekv32, DeepSeek-V4 deepseekv4)")
    g.add_argument("--shutdown-mode", choices=("drain", "abort"), default="drain",
                   help="on SIGTERM: let in-flight requests finish (drain) or end them at once (abort)")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="longest wait in seconds for in-flight requests at shutdown")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="abort a request running longer (seconds)")
    g.add_argument("--uvicorn-log-level", type=str.lower, choices=UVICORN_LOG_LEVELS, default="info",
                   help="uvicorn's log level")
    g.add_argument("--skip-server-warmup", action="store_true",
                   help="open the port at once, without first running short warm-up requests (the first real "
                        "requests then pay the kernel compiles and graph captures)")
    g.add_argument("--warmup-timeout", type=float, default=600.0, help="longest warm-up in seconds (what is left is aborted)")
    s = p.add_argument_group("security and limits (README: Security)")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on every route but /health (default: ${API_KEY_ENV})")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names accepted besides localhost / 127.0.0.1 / ::1 / --host "
                        "('*' = any, '*.example.com' = its subdomains); others get 421 (DNS-rebinding defence)")
    s.add_argument("--allowed-origins", default=None,
                   help="comma-separated CORS origins (scheme://host[:port], '*' = any); default: CORS off")
    # numbers are parsed by server_config, so a bad one is a one-line error like every other check here
    s.add_argument("--max-request-bytes", default=str(4 << 20), help="largest request body in bytes (413 beyond)")
    s.add_argument("--stream-stall-timeout", default="60",
                   help="abort a response whose client has read nothing of what waits for it for this many seconds")
    s.add_argument("--header-timeout", default="10",
                   help="close a connection that has not sent a request's headers within this many seconds")
    p.set_defaults(func=run)


API_KEY_ENV = "DHISPARSE_API_KEY"


def _names(flag: str, value: str | None) -> tuple[str, ...]:
    """A comma-separated flag value -> its entries; an empty entry is an error naming the flag."""
    if value is None:
        return ()
    items = tuple(v.strip() for v in value.split(","))
    if not all(items):
        raise ValueError(f"{flag} has an empty entry in {value!r}; give a comma-separated list")
    return items


def _number(flag: str, text: str, kind: type):
    try:
        return kind(str(text).strip())
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{flag} must be {what}; got {text!r}") from None


def _log_interval(value: float) -> float:
    if not (value >= 0) or value == float("inf"):
        raise ValueError(f"--log-interval must be >= 0 seconds (0 = off); got {value}")
    return value


def server_config(ns: argparse.Namespace):
    from dhisparse.server.app import ServerConfig

    api_key = ns.api_key
    if api_key is None and os.environ.get(API_KEY_ENV) is not None:
        api_key = os.environ[API_KEY_ENV]
        if not api_key:
            raise ValueError(f"{API_KEY_ENV} is set but empty; unset it or give a key")
    elif api_key is not None and not api_key:
        raise ValueError("--api-key is empty; give a key or leave the flag out")
    return ServerConfig(served_model_name=ns.served_model_name, default_max_tokens=ns.default_max_tokens,
                        shutdown_mode=ns.shutdown_mode, drain_timeout_s=ns.drain_timeout,
                        request_timeout_s=ns.request_timeout, host=ns.host, api_key=api_key,
                        allowed_hosts=_names("--allowed-hosts", ns.allowed_hosts),
                        allowed_origins=_names("--allowed-origins", ns.allowed_origins),
                        max_request_bytes=_number("--max-request-bytes", ns.max_request_bytes, int),
                        stream_stall_timeout_s=_number("--stream-stall-timeout", ns.stream_stall_timeout, float),
                        header_timeout_s=_number("--header-timeout", ns.header_timeout, float),
                        log_interval_s=_log_interval(ns.log_interval), tool_call_parser=ns.tool_call_parser)


def check_port(host: str, port: int) -> None:
    """Bind (and release) host:port before the model loads, so a busy port or an address this
    machine does not have is a one-line error now rather than after loading and warm-up."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port}: {host}:{port} is already in use; stop what listens there or pick "
                                 "another --port") from None
            raise ValueError(f"--host {host} --port {port}: cannot bind ({e.strerror})") from None


def run(ns: argparse.Namespace) -> int:
    from dhisparse.server.runner import serve

    if not 0 <= ns.port < 65536:
        raise ValueError(f"--port must be in 0..65535; got {ns.port}")
    if ns.warmup_timeout <= 0:
        raise ValueError(f"--warmup-timeout must be > 0 seconds; got {ns.warmup_timeout}")
    config = server_config(ns)
    econfig = engine_config(ns, full_loader=True)  # every flag checked before anything loads
    check_port(ns.host, ns.port)
    engine = build_engine(ns, econfig)
    if not ns.skip_server_warmup:
        from dhisparse.engine.warmup import warm_up_server

        rep = warm_up_server(engine, timeout_s=ns.warmup_timeout)
        spec = "" if rep.drafted is None else f", speculative rounds verified drafts: {rep.drafted}"
        print(f"dhisparse: warm-up ran {rep.requests} requests, {rep.tokens} tokens in {rep.seconds:.1f} s{spec}", flush=True)
    print(f"dhisparse: serving {config.served_model_name or engine.config.model!r} "
          f"(preset {engine.config.preset}) on http://{ns.host}:{ns.port}/v1", flush=True)
    if config.api_key is None and ns.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"dhisparse: warning: {ns.host} is reachable from the network and no --api-key is set", flush=True)
    try:
        serve(engine, config, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level)
    finally:
        engine.close()  # a data-parallel world stops its ranks
    return 0
