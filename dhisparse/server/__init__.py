"""OpenAI-compatible HTTP server: `create_app(engine)` (`app.py`: routes, request bodies in
`protocol/`, responses and SSE in `responses.py` / `streaming.py`, `/metrics` in `metrics.py`)
over the one engine thread (`worker.py`), `serve(...)` and `ServerThread` for tests (`runner.py`);
request checks - Host, API key, body size - in `guard.py`, header and stall timeouts per connection
in `connection.py`.
May import `engine` and the rooms below it; not `bench` or `cli`."""

from dhisparse.server.app import ServerConfig, create_app
from dhisparse.server.runner import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]
