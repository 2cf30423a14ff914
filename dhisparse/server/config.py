"""`ServerConfig`: the settings of `dhisparse serve` (CLI flags in its docstring), checked at
construction: shutdown mode and timeouts, and the security settings (API key, allowed hosts and
CORS origins, body size, per-connection timeouts), each refusal one line naming its flag."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dhisparse.server.protocol.errors import quote
from dhisparse.server.tools import PARSER_NAMES

SHUTDOWN_MODES = ("drain", "abort")
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
        """API key, allowed hosts and origins, body size and connection timeouts: well-formed."""
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or any(c.isspace() or not c.isprintable() for c in key)):
            raise ValueError("--api-key (api_key) must be a non-empty string without spaces or control characters")
        for h in self.allowed_hosts:
            if not isinstance(h, str) or not _HOST.match(h):
                raise ValueError(f"--allowed-hosts (allowed_hosts): {quote(h)} is not a host name; give names like "
                                 "'api.example.com', '*.example.com', an IP, or '*', comma-separated, without scheme or port")
        for o in self.allowed_origins:
            if not isinstance(o, str) or not (o == "*" or _ORIGIN.match(o)):
                raise ValueError(f"--allowed-origins (allowed_origins): {quote(o)} is not an origin; give "
                                 "scheme://host[:port] (e.g. https://app.example.com) or '*', comma-separated")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes (max_request_bytes) must be a whole number of bytes >= 1; "
                             f"got {quote(self.max_request_bytes)}")
        for flag, name in (("--stream-stall-timeout", "stream_stall_timeout_s"), ("--header-timeout", "header_timeout_s")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{flag} ({name}) must be a finite number of seconds > 0; got {quote(v)}")
