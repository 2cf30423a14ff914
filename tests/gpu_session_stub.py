"""The commands a `bench/gpu_session.sh` step runs, without running them: the script is run with
`timeout` and `python3` replaced by shell functions that record their arguments (tests of steps'
argument lists)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def session_commands(tmp_path: Path, steps: str, env: dict | None = None) -> list[list[str]]:
    """Every python3 argument list (script first) of `bash bench/gpu_session.sh STEPS`, in order,
    with OUT under tmp_path and `env` added."""
    log = tmp_path / "argv.jsonl"
    stub = ('timeout() { while [ "${1#-}" != "$1" ]; do shift 2; done; shift; "$@"; }; '
            f'python3() {{ printf "%s\\0" "$@" >> {shlex.quote(str(log))}; printf "\\n" >> {shlex.quote(str(log))}; }}; '
            "export -f timeout python3; bash bench/gpu_session.sh " + steps)
    subprocess.run(["bash", "-c", stub], cwd=ROOT, check=True, capture_output=True, timeout=60,
                   env={**os.environ, "OUT": str(tmp_path / "out"), **(env or {})})
    return [line.rstrip("\0").split("\0") for line in log.read_text().splitlines() if line]
