"""A training stage's record: the JSON each stage writes into its folder (command, corpus, curves,
held-out metrics), so a shipped checkpoint names how it was made."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_record(folder: str | Path, name: str, stage: str, argv: list[str] | None, **fields) -> dict:
    """{"stage", "command" (this process's `python -m dhisparse.train ...` line), **fields} written
    to folder/name; returns the record."""
    record = {"stage": stage, "command": "python -m dhisparse.train " + " ".join(argv or sys.argv[1:]), **fields}
    (Path(folder) / name).write_text(json.dumps(record, indent=1))
    return record
