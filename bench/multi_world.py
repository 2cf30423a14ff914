"""One parallel world in a child process of its own (bench/multi_gpu.py `serving`).

The parent writes the world's spec (its EngineConfig fields, workload, clients, oracle reference)
to a file and runs `bench/multi_gpu.py _world SPEC PART` in a new session: a fresh CUDA context and
rendezvous, and a hung or failed world is killed with its whole process group after the timeout and
reported. The child (`world_main`) runs `dhisparse.bench.multi.run_world` and writes its result to
PART. SIGTERM / SIGINT of the parent (an outer `timeout`) take the running world's group too (`stop`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "multi_gpu.py"
_CHILD: list = []  # the world's child process now running (killed with its group if this process is stopped)


def run_child(spec: dict, tmp: Path, timeout_s: float) -> dict:
    """One world in a child process (its own session: the whole group is killed past the timeout)."""
    tag = f"{spec['preset'].replace('+', '_')}_{spec['layout'].replace('+', 'p')}"
    spec_path, part, log = tmp / f"{tag}.spec.json", tmp / f"{tag}.part.json", tmp / f"{tag}.log"
    spec_path.write_text(json.dumps(spec))
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "_world", str(spec_path), str(part)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        _CHILD[:] = [proc]
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        finally:
            _CHILD.clear()
    wall = time.perf_counter() - t
    tail = log.read_text(errors="replace")[-3000:]
    for line in tail.splitlines()[-6:]:
        print(f"    | {line[:200]}", flush=True)
    if rc == 0 and part.exists():
        out = json.loads(part.read_text())
        out["times"]["child_wall_s"] = wall
        return out
    return {"layout": {"name": spec["layout"]}, "preset": spec["preset"], "error": f"exit {rc} after {wall:.0f} s",
            "log_tail": tail}


def world_main(spec_path: str, part_path: str) -> int:
    """The child: one world, its result written to part_path."""
    from dhisparse.bench import multi as M
    from dhisparse.bench.workload import Workload
    from dhisparse.engine.config import EngineConfig

    spec = json.loads(Path(spec_path).read_text())
    M.multicast_off()
    layout = M.parse_layout(spec["layout"])
    cfg = EngineConfig(**spec["engine"])
    w = spec["workload"]
    workload = Workload(input_len=w["input_len"], output_len=w["output_len"], duration_s=w["duration_s"],
                        timeout_s=w["duration_s"] + 600)
    ref = spec.get("reference")
    reference = (Path(ref["path"]), ref["key"]) if ref else None
    out = M.run_world(cfg, layout, workload, spec["concurrency"], spec["distinct"], reference,
                      progress=lambda s: print(s, flush=True))
    Path(part_path).write_text(json.dumps(out))
    return 0


def stop(signum, frame) -> None:
    """SIGTERM / SIGINT (an outer `timeout`): the running world's process group goes too, then exit."""
    for proc in _CHILD:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    raise SystemExit(128 + signum)


def stop_children_on_signals() -> None:
    """`stop` on SIGTERM and SIGINT."""
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
