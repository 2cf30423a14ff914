"""OpenAI-compatible HTTP server: `create_app(engine)` (`app.py`: the app, its error handlers and
/openapi.json; settings in `config.py`, shared state in `state.py`; routes in `routes/`, request
bodies and errors in `protocol/`, responses and SSE in `responses.py` / `streaming.py`, `/metrics`
in `metrics.py`) over the one engine thread (`worker.py`), `serve(...)` and `ServerThread` for
tests (`runner.py`); request checks - Host, API key, body size - in `guard.py`, header and stall
timeouts per connection in `connection.py`.
May import `engine` and the rooms below it; not `bench` or `cli`."""

from dhisparse.server.app import create_app
from dhisparse.server.config import ServerConfig
from dhisparse.server.runner import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]
