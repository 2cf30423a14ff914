"""Copy engines: every issued copy is reported done exactly once, after its event fired, in any
order; the side-stream copy starts after the compute-stream fence of its issue."""

from __future__ import annotations

from dhisparse.kv.copies import Done, StreamCopyEngine, SyncCopyEngine


class ManualStreams:
    """Events fire when the test says so; records the order of fences and copies."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.fired: set[int] = set()
        self.n = 0

    def fence(self) -> str:
        self.log.append("fence")
        return "fence"

    def on_side(self, after, fn) -> int:
        assert after == "fence" and self.log[-1] == "fence"  # the copy is ordered after its fence
        fn()
        self.n += 1
        return self.n - 1

    def finished(self, event: int) -> bool:
        return event in self.fired


def test_stream_engine_reports_each_copy_once_when_its_event_fires():
    copied = []
    streams = ManualStreams()
    eng = StreamCopyEngine(lambda kind, req, j, page: copied.append((kind, req, j, page)), streams)
    for j in range(4):
        eng.issue("backup" if j % 2 else "populate", "r", j, 10 + j)
    assert len(copied) == 4 and eng.in_flight() == 4 and eng.poll() == []
    streams.fired |= {2, 0}
    assert eng.poll() == [Done("populate", "r", 0), Done("populate", "r", 2)]
    assert eng.poll() == [] and eng.in_flight() == 2
    streams.fired |= {1, 3}
    assert eng.poll() == [Done("backup", "r", 1), Done("backup", "r", 3)]
    assert eng.in_flight() == 0


def test_sync_engine_copies_at_issue_and_reports_at_poll():
    copied = []
    eng = SyncCopyEngine(lambda *a: copied.append(a))
    eng.issue("backup", "q", 5, 7)
    assert copied == [("backup", "q", 5, 7)] and eng.in_flight() == 1
    assert eng.poll() == [Done("backup", "q", 5)] and eng.poll() == []
