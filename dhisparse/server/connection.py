"""`GuardedH11Protocol`: uvicorn's h11 connection with two timeouts uvicorn lacks.

* Header read timeout (--header-timeout): a connection must deliver a whole request line and
  headers within `header_timeout_s` of connecting, or of sending the first byte of its next
  request on a kept-alive connection; otherwise it is closed (slow-loris defence). uvicorn's own
  `timeout_keep_alive` only runs between requests and h11's `max_incomplete_event_size` only
  bounds the header size, so neither stops a client that trickles its headers.
* Stall timeout (--stream-stall-timeout): while the server has response bytes waiting for the
  client (in the transport's buffer or the kernel's send queue) and the client acknowledges none
  of them for `stall_timeout_s`, the client has stopped reading: the connection is aborted. The
  app sees an `http.disconnect`, so the stream's request is aborted and its KV pages freed; the
  request's scope is marked (`scope["state"]["dhisparse.stalled"]`) so the abort is counted as a
  stall. Progress is read from the kernel (Linux `TCP_INFO.tcpi_bytes_acked`), not from the
  transport's flow control: the kernel's auto-tuned send buffer holds megabytes, so a stalled
  client would otherwise go unnoticed for tens of thousands of tokens. Elsewhere the same count is
  derived: the bytes written to the transport (`_CountingTransport`) less those still waiting
  (transport buffer + kernel send queue) are the bytes the client's kernel took. A check with
  nothing written since the last and the transport's buffer empty does not count towards a stall:
  over loopback delayed ACKs keep 0.5-2 KB unacknowledged, and an engine that sends nothing for a
  while is not a client that stopped reading.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # POSIX; elsewhere the kernel's send queue is not read
    import fcntl
    import termios
except ImportError:  # pragma: no cover
    fcntl = termios = None

log = logging.getLogger("dhisparse.server")
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED_OFFSET = 120  # struct tcp_info: 8 u8 + 24 u32 + pacing_rate, max_pacing_rate (u64), bytes_acked
STALLED_KEY = "dhisparse.stalled"


def _bytes_acked(sock) -> int | None:
    if sock is None or _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_OFFSET + 8:
        return None
    return struct.unpack_from("Q", info, _BYTES_ACKED_OFFSET)[0]


def _unsent(sock) -> int:
    """Bytes in the kernel's send queue (not yet acknowledged by the peer); 0 where unknown."""
    if sock is None or fcntl is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0


class _CountingTransport:
    """The connection's transport, counting the bytes written through it (`written`); everything else
    is the transport's own (uvicorn writes its responses with `write`)."""

    def __init__(self, transport) -> None:
        self._transport = transport
        self.written = 0

    def write(self, data) -> None:
        self.written += len(data)
        self._transport.write(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def __getattr__(self, name):
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """See the module docstring; `guarded_protocol(...)` makes one with the two timeouts set."""

    header_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(_CountingTransport(transport))  # self.transport: the counting one
        self._sock = transport.get_extra_info("socket")
        self._header_timer = None
        self._stall_timer = None
        self._progress = (None, 0)  # (bytes the client took, bytes written) at the last check
        self._progress_at = time.monotonic()
        self._arm_header_timer()
        self._schedule_stall_check()

    def connection_lost(self, exc) -> None:
        for timer in (self._header_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._stall_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    # -- header read timeout ----------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request headers within %.0f s (--header-timeout)",
                     self.header_timeout_s)
            self.transport.close()

    # -- stall timeout ----------------------------------------------------------------------------
    def _schedule_stall_check(self) -> None:
        interval = min(1.0, max(0.05, self.stall_timeout_s / 4))
        self._stall_timer = self.loop.call_later(interval, self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        now = time.monotonic()
        buffered = self.transport.get_write_buffer_size()
        pending = buffered + _unsent(self._sock)
        written = self.transport.written
        acked = _bytes_acked(self._sock)
        if acked is None:  # no TCP_INFO: what was written and no longer waits reached the client's kernel
            acked = written - pending
        last_acked, last_written = self._progress
        moved = acked != last_acked
        # nothing new to send and nothing buffered: what waits is a residue of delayed ACKs, not a stall
        idle = written == last_written and buffered == 0
        self._progress = (acked, written)
        if pending == 0 or moved or idle:  # nothing waits, or the client took some of it
            self._progress_at = now
        elif now - self._progress_at >= self.stall_timeout_s:
            self._abort_stalled(pending)
            return
        self._schedule_stall_check()

    def _abort_stalled(self, pending: int) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.scope.setdefault("state", {})[STALLED_KEY] = True
        log.warning("aborting a connection whose client read nothing for %.1f s with %d bytes waiting "
                    "(--stream-stall-timeout)", self.stall_timeout_s, pending)
        self.transport.abort()


def guarded_protocol(header_timeout_s: float, stall_timeout_s: float) -> type[GuardedH11Protocol]:
    """A GuardedH11Protocol subclass with these timeouts (uvicorn.Config(http=...) takes a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "stall_timeout_s": float(stall_timeout_s)})
