"""Running the app under uvicorn: blocking (`serve`) or in a background thread (`ServerThread`).

`GracefulServer` tells the app to stop accepting work (and, in abort mode, to end in-flight
requests) before uvicorn's own shutdown waits up to `drain_timeout_s` for open responses;
the app's lifespan end then stops the engine thread, aborting whatever is left.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from dhisparse.server.app import ServerConfig, create_app


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that calls the app's `begin_shutdown()` first on SIGTERM / should_exit."""

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "dhisparse", None)
        if state is not None:
            state.begin_shutdown()
        await super().shutdown(sockets=sockets)


def _uvicorn_config(app, config: ServerConfig, log_level: str, **kw) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level.lower(), lifespan="on",
                          timeout_graceful_shutdown=int(max(1, round(config.drain_timeout_s))), **kw)


def serve(engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM."""
    app = create_app(engine, config)
    GracefulServer(_uvicorn_config(app, config, log_level, host=host, port=port)).run()


class ServerThread:
    """Serve `engine` from a background thread on a free local port (tests, in-process benches).

    >>> with ServerThread(engine) as srv:
    ...     httpx.get(srv.url + "/health")
    """

    def __init__(self, engine, config: ServerConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
        self.config = config or ServerConfig()
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
        """Graceful shutdown (drain or abort per config); joins the thread within the drain timeout + 10 s."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s if timeout_s is not None else self.config.drain_timeout_s + 10)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
