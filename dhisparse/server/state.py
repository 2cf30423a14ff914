"""`ServerState`: what the routes share - the engine worker (`worker.py`), metrics, settings, the
tool-call format, and whether new work is accepted (shutdown and engine health checks)."""

from __future__ import annotations

import asyncio
import time

from dhisparse.engine.progress import ServingLog
from dhisparse.server.config import ServerConfig
from dhisparse.server.metrics import ServerMetrics
from dhisparse.server.protocol.errors import ApiError
from dhisparse.server.tools import choose_format
from dhisparse.server.worker import EngineWorker


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
        """A 503 while the server shuts down or when the engine thread is not running."""
        if not self.accepting:
            raise ApiError("the server is shutting down; retry on another replica", status=503,
                           type_="server_error", code="shutting_down")
        if not self.worker.alive:
            raise ApiError(self.worker.error or "the engine thread is not running", status=503,
                           type_="server_error", code="engine_dead")
