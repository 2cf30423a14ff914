"""OpenAI-compatible HTTP server: `create_app(engine)`, `serve(...)`, `ServerThread` for tests."""

from dhisparse.server.app import ServerConfig, create_app
from dhisparse.server.runner import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]
