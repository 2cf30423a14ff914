"""`RequestGuard`: the checks every HTTP request passes before a route runs (a pure ASGI middleware).

In order:
  1. Host header: the bound address (localhost, 127.0.0.1, ::1, the --host value; any port) or an
     --allowed-hosts entry ("*" = any, "*.example.com" = its subdomains). When bound to a wildcard
     address (0.0.0.0 / ::) any IP literal is accepted too: a browser sends a name, never an IP, in a
     DNS-rebinding attack. A foreign Host gets 421 (`invalid_host`).
  2. API key (--api-key / DHISPARSE_API_KEY): `Authorization: Bearer <key>` on every route but
     /health; 401 (`invalid_api_key`) otherwise, compared in constant time.
  3. Body size (--max-request-bytes): a Content-Length over the limit is refused before any byte of
     the body is read; a chunked body is counted while it is read and refused (413,
     `request_too_large`) the moment it passes the limit, so no unbounded body is ever buffered.
It also counts requests in flight (what shutdown drains) and, once the server is shutting down,
ends a request that uvicorn cancels quietly instead of letting the CancelledError reach its log.
The JSON content-type check (415) is done by the JSON routes themselves (routes/prepare.py `read_json`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from typing import TYPE_CHECKING, Iterable

from dhisparse.server.protocol.errors import ApiError

if TYPE_CHECKING:
    from dhisparse.server.state import ServerState

log = logging.getLogger("dhisparse.server")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
OPEN_PATHS = ("/health",)  # answered without an API key (load balancers, liveness probes)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds {limit} bytes (--max-request-bytes)", status=413,
                         code="request_too_large", headers={"Connection": "close"})


def host_name(value: str) -> str | None:
    """The host part of a Host header ("name", "name:port", "[v6]:port"), lowercased; None if malformed."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        rest = v[end + 1:] if end > 0 else None
        if rest is None or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return v[1:end]
    if v.count(":") > 1:
        return None
    name, _, port = v.partition(":")
    name = name.rstrip(".")  # "localhost." is localhost
    if not name or (_ and not port.isdigit()):
        return None
    return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which Host headers are ours (see the module docstring)."""

    def __init__(self, bind_host: str, allowed: Iterable[str]) -> None:
        allowed = [a.strip().lower() for a in allowed]
        self.any = "*" in allowed
        bind = bind_host.strip().lower().strip("[]")
        self.wildcard_bind = bind in WILDCARD_ADDRESSES
        self.names = set(LOOPBACK_NAMES) | ({bind} if not self.wildcard_bind else set())
        self.names |= {a for a in allowed if not a.startswith("*.")}
        self.suffixes = tuple(a[1:] for a in allowed if a.startswith("*."))

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:  # no Host at all: HTTP/1.0 (h11 demands one in HTTP/1.1)
            return True
        name = host_name(header)
        if name is None:
            return False
        ours = name in self.names or (bool(self.suffixes) and name.endswith(self.suffixes))
        return ours or (self.wildcard_bind and _is_ip(name))


class RequestGuard:
    """Pure ASGI middleware; see the module docstring."""

    def __init__(self, app, state: "ServerState", bind_host: str, allowed_hosts: Iterable[str],
                 api_key: str | None, max_request_bytes: int) -> None:
        self.app, self.state = app, state
        self.hosts = HostPolicy(bind_host, allowed_hosts)
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        err = self._check(scope, headers)
        if err is not None:
            self.state.metrics.observe_rejected(err.status)
            await send_error(send, err)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.state.inflight += 1
        try:
            await self.app(scope, self._limited(receive), tracking_send)
        except BodyTooLarge as e:  # read outside a route (where app.py's handler turns it into JSON)
            if not started:
                await send_error(send, e)
        except asyncio.CancelledError:
            if self.state.accepting:
                raise
            log.info("%s %s ended by the shutdown", scope.get("method"), scope.get("path"))
        finally:
            self.state.inflight -= 1

    def _check(self, scope, headers: dict[bytes, bytes]) -> ApiError | None:
        host = headers.get(b"host")
        if not self.hosts.allows(None if host is None else host.decode("latin-1")):
            return ApiError("the Host header names a host this server does not serve; add it to --allowed-hosts",
                            status=421, code="invalid_host")
        if self.api_key is not None and scope.get("path") not in OPEN_PATHS:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
                return ApiError("missing or invalid API key; send 'Authorization: Bearer <key>'", status=401,
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                return ApiError("invalid Content-Length header", code="invalid_request")
            if int(length) > self.max_body:
                return BodyTooLarge(self.max_body)
        return None

    def _limited(self, receive):
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        return limited_receive


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", ())}


async def send_error(send, err: ApiError) -> None:
    """Send an OpenAI-shaped JSON error as a whole response."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
