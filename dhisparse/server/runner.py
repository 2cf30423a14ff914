"""Running the app under uvicorn: blocking (`serve`) or in a background thread (`ServerThread`).

Shutdown (`GracefulServer.shutdown`, on SIGTERM / should_exit): the listening sockets close, the
app stops accepting work (503 for new requests; in abort mode in-flight requests end at once),
in-flight requests get up to `drain_timeout_s` to finish, and then every one still running is
aborted through the engine, so each stream ends with an abort chunk and `data: [DONE]` and each
non-streamed request with a JSON 503 - rather than uvicorn cancelling the handlers mid-chunk.
Only then does uvicorn's own shutdown run (idle connections close; a response whose client does
not read at all is cut after `FINAL_GRACE_S`), and the app's lifespan end stops the engine thread.

Connections speak HTTP/1.1 through `GuardedH11Protocol` (connection.py): uvicorn's h11 protocol
plus a header read timeout and the stall timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

import uvicorn

from dhisparse.server.app import create_app
from dhisparse.server.config import ServerConfig
from dhisparse.server.connection import guarded_protocol

log = logging.getLogger("dhisparse.server")
ABORT_GRACE_S = 5.0  # after the drain timeout: time for aborted requests to send their last chunk
FINAL_GRACE_S = 3  # then uvicorn's own graceful shutdown (timeout_graceful_shutdown)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains, then aborts, the app's requests before its own shutdown."""

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "dhisparse", None)
        if state is not None:
            for server in self.servers:  # no new connections while draining
                server.close()
            state.begin_shutdown()
            if not await state.wait_idle(state.config.drain_timeout_s):
                log.warning("drain timeout (%.0f s): aborting %d request(s) still in flight",
                            state.config.drain_timeout_s, state.inflight)
                state.worker.abort_all()
                await state.wait_idle(ABORT_GRACE_S)
        await super().shutdown(sockets=sockets)


def _uvicorn_config(app, config: ServerConfig, log_level: str, **kw) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level.lower(), lifespan="on", timeout_graceful_shutdown=FINAL_GRACE_S,
                          http=guarded_protocol(config.header_timeout_s, config.stream_stall_timeout_s), **kw)


def serve(engine, config: ServerConfig, host: str | None = None, port: int = 30000, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM (on `host`, default `config.host`)."""
    config = dataclasses.replace(config, host=host or config.host)
    app = create_app(engine, config)
    GracefulServer(_uvicorn_config(app, config, log_level, host=config.host, port=port)).run()


class ServerThread:
    """Serve `engine` from a background thread on a free local port (tests, in-process benches).

    >>> with ServerThread(engine) as srv:
    ...     httpx.get(srv.url + "/health")
    """

    def __init__(self, engine, config: ServerConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
        self.config = dataclasses.replace(config or ServerConfig(), host=host)
        self.app = create_app(engine, self.config)
        self.host, self._port, self.start_timeout_s = host, port, start_timeout_s
        self.server = GracefulServer(_uvicorn_config(self.app, self.config, log_level))
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def state(self):
        return self.app.state.dhisparse

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.host, self._port))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="dhisparse-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start within {self.start_timeout_s:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful shutdown (drain or abort per config); joins the thread within the drain timeout
        plus the abort and final graces and 10 s."""
        self.server.should_exit = True
        if self._thread is not None:
            limit = self.config.drain_timeout_s + ABORT_GRACE_S + FINAL_GRACE_S + 10
            self._thread.join(timeout_s if timeout_s is not None else limit)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
