"""Copy engines: every issued copy is reported done exactly once, after its batch's event fired,
batches in any order; a batch's side-stream copies start after the compute-stream fence recorded
when it is launched (at the poll after their issue)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from dhisparse.kv.memory.copies import Done, PageRun, StreamCopyEngine, SyncCopyEngine, page_runs


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


def test_stream_engine_reports_each_copy_once_when_its_batch_fires():
    copied = []
    streams = ManualStreams()
    eng = StreamCopyEngine(lambda kind, req, j, page: copied.append((kind, req, j, page)), streams)
    eng.issue("populate", "r", 0, 10)
    eng.issue("populate", "r", 2, 12)
    assert copied == [] and eng.in_flight() == 2  # staged: nothing launched before the poll
    assert eng.poll() == [] and len(copied) == 2  # batch 0 launched
    eng.issue("backup", "r", 1, 11)
    eng.issue("backup", "r", 3, 13)
    assert eng.poll() == [] and eng.in_flight() == 4  # batch 1 launched
    streams.fired.add(1)  # batches finish in any order
    assert eng.poll() == [Done("backup", "r", 1), Done("backup", "r", 3)]
    assert eng.poll() == [] and eng.in_flight() == 2
    streams.fired.add(0)
    assert eng.poll() == [Done("populate", "r", 0), Done("populate", "r", 2)]
    assert eng.in_flight() == 0 and eng.poll() == []
    assert copied == [("populate", "r", 0, 10), ("populate", "r", 2, 12), ("backup", "r", 1, 11), ("backup", "r", 3, 13)]


def test_stream_engine_pays_one_fence_and_one_event_per_batch():
    """The host cost that batching removes: 32 backups issued in one step launch as one batch."""
    streams = ManualStreams()
    eng = StreamCopyEngine(lambda *a: None, streams)
    for j in range(32):
        eng.issue("backup", "r", j, j)
    eng.flush()
    eng.flush()  # nothing staged: no empty batch
    assert streams.log == ["fence"] and streams.n == 1
    streams.fired.add(0)
    assert len(eng.poll()) == 32 and streams.n == 1


def test_sync_engine_copies_at_issue_and_reports_at_poll():
    copied = []
    eng = SyncCopyEngine(lambda *a: copied.append(a))
    eng.issue("backup", "q", 5, 7)
    assert copied == [("backup", "q", 5, 7)] and eng.in_flight() == 1
    assert eng.poll() == [Done("backup", "q", 5)] and eng.poll() == []


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["backup", "populate"]), hs.integers(0, 40)), max_size=30, unique_by=lambda x: x[1]),
       hs.randoms())
def test_page_runs_cover_every_copy_once_and_merge_adjacent_pages(copies, rnd):
    """Each (kind, host, device) copy lies in exactly one run; a run is one kind over pages that
    advance together on both sides; two copies adjacent on both sides never sit in separate runs."""
    host = list(range(100, 100 + len(copies)))
    rnd.shuffle(host)
    pairs = [(kind, h if rnd.random() < 0.3 else 100 + d, d) for (kind, d), h in zip(copies, host)]
    runs = page_runs(pairs)
    expanded = [(r.kind, r.host + i, r.device + i) for r in runs for i in range(r.count)]
    assert sorted(expanded) == sorted(pairs) and all(r.count >= 1 for r in runs)
    ends = {(r.kind, r.host + r.count, r.device + r.count) for r in runs}
    assert not any((r.kind, r.host, r.device) in ends for r in runs), "two mergeable runs left apart"


def test_page_runs_example():
    pairs = [("backup", 41, 8), ("backup", 40, 7), ("backup", 5, 12), ("backup", 42, 9), ("populate", 43, 10)]
    assert page_runs(pairs) == [PageRun("backup", 40, 7, 3), PageRun("backup", 5, 12, 1), PageRun("populate", 43, 10, 1)]
    assert page_runs([]) == []
