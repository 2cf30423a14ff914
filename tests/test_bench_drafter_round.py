"""bench/drafter_round.py at a CI size: every mode runs, the drafts agree, the block pass from a
graph dispatches fewer ops than the eager round, and the result file names its baseline."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import drafter_round  # noqa: E402


def test_drafter_round_runs_every_mode(tmp_path):
    out = tmp_path / "round.json"
    assert drafter_round.main(["--device", "cpu", "--dtype", "float32", "--model", "tiny", "--shape", "target",
                               "--requests", "3", "--window", "16", "--rounds", "1", "--warmup", "0",
                               "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = {r["mode"]: r for r in doc["runs"]}
    assert list(runs) == ["per_head", "grouped", "graph"] and doc["kind"] == "drafter_round"
    summary = doc["config"]["summary"]
    assert summary["drafts_equal_to_per_head"] == {"grouped": True, "graph": True}
    assert "grouped_over_per_head" in summary and "graph_over_per_head" in summary
    assert runs["graph"]["ops"] < runs["grouped"]["ops"] and runs["grouped"]["allocated_bytes"] > 0
