"""`dhisparse serve`: the OpenAI-compatible HTTP server (see dhisparse.server)."""

from __future__ import annotations

import argparse

from dhisparse.cli.args import HelpFormatter, add_engine_args, engine_config


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
    g.add_argument("--default-max-tokens", type=int, default=256, help="output cap for requests without max_tokens")
    g.add_argument("--shutdown-mode", choices=("drain", "abort"), default="drain",
                   help="on SIGTERM: let in-flight requests finish (drain) or end them at once (abort)")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="longest wait in seconds for in-flight requests at shutdown")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="abort a request running longer (seconds)")
    g.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    g.add_argument("--skip-server-warmup", action="store_true",
                   help="open the port at once, without first running short warm-up requests (the first real "
                        "requests then pay the kernel compiles and graph captures)")
    g.add_argument("--warmup-timeout", type=float, default=600.0, help="longest warm-up in seconds (what is left is aborted)")
    p.set_defaults(func=run)


def server_config(ns: argparse.Namespace):
    from dhisparse.server.app import ServerConfig

    return ServerConfig(served_model_name=ns.served_model_name, default_max_tokens=ns.default_max_tokens,
                        shutdown_mode=ns.shutdown_mode, drain_timeout_s=ns.drain_timeout,
                        request_timeout_s=ns.request_timeout)


def run(ns: argparse.Namespace) -> int:
    from dhisparse.engine.engine import Engine
    from dhisparse.server.runner import serve

    if not 0 <= ns.port < 65536:
        raise ValueError(f"--port must be in 0..65535; got {ns.port}")
    if ns.warmup_timeout <= 0:
        raise ValueError(f"--warmup-timeout must be > 0 seconds; got {ns.warmup_timeout}")
    config = server_config(ns)
    engine = Engine(engine_config(ns))
    if not ns.skip_server_warmup:
        from dhisparse.engine.warmup import warm_up_server

        rep = warm_up_server(engine, timeout_s=ns.warmup_timeout)
        spec = "" if rep.drafted is None else f", speculative rounds verified drafts: {rep.drafted}"
        print(f"dhisparse: warm-up ran {rep.requests} requests, {rep.tokens} tokens in {rep.seconds:.1f} s{spec}", flush=True)
    print(f"dhisparse: serving {config.served_model_name or engine.config.model!r} "
          f"(preset {engine.config.preset}) on http://{ns.host}:{ns.port}/v1", flush=True)
    serve(engine, config, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level)
    return 0
