"""The stall rule of `server/connection.py` (`GuardedH11Protocol._check_stall`) on scripted checks: what the
transport holds, what the kernel's send queue holds and what was written, check by check, without a socket.

The served tests (`test_server_security.py`) run it over loopback, where the residue of delayed ACKs made the
fallback's earlier rule (the bytes waiting must shrink from one check to the next) abort a reading client now
and then on a loaded machine; here each case is exact.

Breakages tried (each fails a test here): the earlier rule (waiting bytes compared with the last check), no
idle exemption, the idle exemption also while the transport buffers bytes, the derived count without the bytes
waiting in the kernel (acked = written - buffered)."""

from __future__ import annotations

import pytest

from dhisparse.server import connection as cn


class _Transport:
    def __init__(self):
        self.buffered, self.aborted = 0, False

    def get_write_buffer_size(self):
        return self.buffered

    def is_closing(self):
        return self.aborted

    def abort(self):
        self.aborted = True

    def write(self, data):
        pass


class _Loop:
    def call_later(self, delay, fn):
        return None


def _protocol(monkeypatch, kernel_acks: bool, stall_s: float = 1.0):
    """A protocol made without uvicorn's machinery: the transport counted as `connection_made` counts it."""
    p = object.__new__(cn.GuardedH11Protocol)
    raw = _Transport()
    p.transport, p._sock, p.loop, p.cycle = cn._CountingTransport(raw), None, _Loop(), None
    p.stall_timeout_s = stall_s
    p._progress, p._progress_at = (None, 0), 0.0
    state = {"unsent": 0, "acked": 0, "now": 0.0}
    monkeypatch.setattr(cn, "_unsent", lambda sock: state["unsent"])
    monkeypatch.setattr(cn, "_bytes_acked", (lambda sock: state["acked"]) if kernel_acks else (lambda sock: None))
    monkeypatch.setattr(cn.time, "monotonic", lambda: state["now"])
    return p, raw, state


def _run(p, raw, state, checks, dt=0.25) -> int | None:
    """checks: (bytes written since the last check, transport-buffered, kernel unsent, kernel acked) per check.
    Returns the index of the check that aborted, or None."""
    for i, (w, buffered, unsent, acked) in enumerate(checks):
        state["now"] += dt
        p.transport.write(b"x" * w)
        raw.buffered, state["unsent"], state["acked"] = buffered, unsent, acked
        p._check_stall()
        if raw.aborted:
            return i
    return None


def test_a_reading_client_with_a_growing_delayed_ack_residue_is_not_stalled(monkeypatch):
    """Writes keep arriving and the client's kernel takes them, while the unacknowledged residue happens to
    grow at every check (1.2 to 2.2 KB): the bytes taken still grow, so no abort (the earlier fallback rule,
    the waiting bytes never shrinking, aborted here)."""
    p, raw, state = _protocol(monkeypatch, kernel_acks=False)
    residue = [1200, 1500, 1800, 2198, 2198, 2300, 2400, 2500, 2600, 2700]
    assert _run(p, raw, state, [(900, 0, r, 0) for r in residue]) is None


def test_an_idle_stream_with_a_residue_is_not_stalled(monkeypatch):
    """The engine writes nothing for two seconds (a loaded machine) and 2,198 B stay unacknowledged with the
    transport empty: not a stall."""
    p, raw, state = _protocol(monkeypatch, kernel_acks=False)
    assert _run(p, raw, state, [(500, 0, 2198, 0)] + [(0, 0, 2198, 0)] * 8) is None


@pytest.mark.parametrize("kernel_acks", [True, False])
def test_a_client_that_takes_nothing_is_aborted_after_the_timeout(monkeypatch, kernel_acks):
    """Every byte written stays waiting (the kernel's queue grows by what was written): aborted at the first
    check a whole timeout (1 s, checks 0.25 s apart) after the last progress."""
    p, raw, state = _protocol(monkeypatch, kernel_acks)
    checks = [(700, 0, 700 * (i + 1), 0) for i in range(10)]
    assert _run(p, raw, state, checks) == 4


@pytest.mark.parametrize("kernel_acks", [True, False])
def test_a_stalled_client_behind_flow_control_is_aborted(monkeypatch, kernel_acks):
    """The kernel's queue is full and the transport holds 70 KB, so uvicorn stopped writing: nothing is written
    and nothing is taken, which is a stall (the idle exemption needs an empty transport)."""
    p, raw, state = _protocol(monkeypatch, kernel_acks)
    checks = [(4000, 0, 4000, 0), (70_000, 70_000, 4000, 0)] + [(0, 70_000, 4000, 0)] * 8
    assert _run(p, raw, state, checks) == 4


def test_kernel_acks_are_progress_even_while_the_residue_grows(monkeypatch):
    """With TCP_INFO the kernel's acknowledged count is the signal: it grows, so no abort."""
    p, raw, state = _protocol(monkeypatch, kernel_acks=True)
    checks = [(900, 0, 1000 + 100 * i, 900 * (i + 1) - 1000 - 100 * i) for i in range(10)]
    assert _run(p, raw, state, checks) is None


def test_the_counting_transport_counts_writes_and_passes_the_rest_through():
    raw = _Transport()
    t = cn._CountingTransport(raw)
    t.write(b"abc")
    t.writelines([b"de", b"f"])
    raw.buffered = 7
    assert t.written == 6 and t.get_write_buffer_size() == 7 and not t.is_closing()
