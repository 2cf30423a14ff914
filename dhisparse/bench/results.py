"""Result files: plain dataclasses -> JSON, with the command line, machine and date.

Schema (`schema_version` 1; `kind` = "bench" or "loadstep"; NaN / inf are written as null):
    date (ISO, local tz), commit (the source commit, `source_commit`), command ("dhisparse bench ..."), machine {platform, python, hostname,
    cpu_count, cpu, torch, gpus?}, config {engine {EngineConfig fields} | {url}, workload
    {Workload fields}, concurrency [..] (bench) | arms, unavailable_arms, phases (loadstep), wall_s},
    available_presets, unavailable_presets, notes [str],
    runs [{preset, concurrency, target ("in-process" or the URL),
           metrics {concurrency, duration_s, requests_submitted, requests_completed, output_tokens,
                    output_tok_s, ttft_mean_ms, ttft_p99_ms, post_wave_ttft_mean_ms,
                    post_wave_ttft_p99_ms, tpot_mean_ms, tpot_p99_ms, active, slots,
                    queue_mean_ms, counters {host_fetched_share, coverage, ... when reported},
                    central_output_tok_s},
           engine {final stats().as_dict()},
           series [{t, output_tok_s, decoding, <every numeric engine stat>}],
           requests [{index, client, submit, first, finish, output_len, prompt_len,
                      finish_reason, queue, ttft, tpot}]   (seconds from the run's start),
           phases [{name, concurrency, start_s, end_s, requests, output_tok_s, ttft_mean_ms,
                    tpot_mean_ms, tok_s_per_session, queue_mean_ms, slots_max,
                    host_fetched_share, coverage, ...}]   (loadstep only)}]
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dhisparse.bench.records import RequestRecord, RunMetrics, RunTrace, summarize

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RunResult:
    """One (preset, concurrency) run; `phases` holds per-phase summaries of a load step."""

    preset: str
    concurrency: int
    target: str
    metrics: RunMetrics
    engine: dict
    series: list[dict]
    requests: list[dict]
    phases: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class ResultFile:
    kind: str
    date: str
    command: str
    machine: dict
    config: dict
    available_presets: list[str]
    unavailable_presets: list[str]
    runs: list[RunResult]
    notes: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    commit: str | None = None


def new_result(kind: str, argv: list[str] | None, config: dict, runs: list, notes: list[str] | None = None) -> "ResultFile":
    """A result file stamped with the date, the command line, the machine and the preset lists."""
    from dhisparse.engine.config import AVAILABLE_PRESETS, PRESETS

    return ResultFile(kind, now_iso(), command_line(argv), machine_info(), config, list(AVAILABLE_PRESETS),
                      [p for p in PRESETS if p not in AVAILABLE_PRESETS], runs, list(notes or []), commit=source_commit())


def source_commit() -> str | None:
    """The commit the code ran at: $DHISPARSE_COMMIT (set by the caller where the tree has no .git,
    e.g. a device machine), else `git rev-parse --short HEAD` in the package's checkout, else None."""
    if os.environ.get("DHISPARSE_COMMIT"):
        return os.environ["DHISPARSE_COMMIT"]
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def request_dict(r: RequestRecord) -> dict:
    d = r._asdict()
    d.update(ttft=r.ttft, tpot=r.tpot)
    return d


def run_result(preset: str, concurrency: int, target: str, trace: RunTrace, phases: list[dict] | None = None) -> RunResult:
    return RunResult(preset, concurrency, target, summarize(trace, concurrency), trace.engine,
                     list(trace.series), [request_dict(r) for r in trace.requests], phases or [])


def machine_info() -> dict:
    """Where the numbers came from: OS, Python, torch, CPU, GPUs."""
    info = {"platform": platform.platform(), "python": sys.version.split()[0], "hostname": platform.node(),
            "cpu_count": os.cpu_count(), "cpu": _cpu_model()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def command_line(argv: list[str] | None = None) -> str:
    return shlex.join(["dhisparse", *(sys.argv[1:] if argv is None else argv)])


def _clean(o):
    """dataclasses / tuples / non-finite floats -> plain JSON values (NaN and inf become None)."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return _clean(dataclasses.asdict(o))
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set)):
        return [_clean(v) for v in o]
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if o is None or isinstance(o, (str, int, bool)):
        return o
    return str(o)


def to_jsonable(result: ResultFile) -> dict:
    return _clean(result)


def write_json(result: ResultFile, path: str | Path) -> Path:
    """Write the result as indented JSON and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(result), indent=1, allow_nan=False) + "\n")
    return path


def write_bench(kind: str, ns, runs: list, notes: list[str], **config) -> Path:
    """A micro-benchmark's result file at ns.out: its config is ns's attributes (argv aside) then
    `config`; prints "[done] <path>" and returns the path."""
    cfg = {k: v for k, v in vars(ns).items() if k != "argv"} | config
    path = write_json(new_result(kind, ns.argv, cfg, runs, notes), ns.out)
    print(f"[done] {path}")
    return path


def write_doc(kind: str, ns, path: str | Path, json_default=None, **fields) -> Path:
    """Write a plain benchmark document: kind, date, commit, the command (ns.argv), machine and config
    (ns's other attributes), then `fields`; indented JSON (`json_default`: json.dumps's `default`, for values
    JSON has no form for). Written whole or not at all (a file beside it, then renamed), so a script that
    rewrites its document as it goes never leaves a half-written one. Returns the path."""
    doc = {"kind": kind, "date": now_iso(), "commit": source_commit(), "command": command_line(ns.argv),
           "machine": machine_info(), "config": {k: v for k, v in vars(ns).items() if k != "argv"}, **fields}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=json_default) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: str | Path) -> dict:
    """Load a result file; raises ValueError naming the file when it is not one of ours."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a result JSON ({e})") from None
    if not isinstance(data, dict) or ("kind" not in data and "records" not in data):
        raise ValueError(f"{path}: not a dhisparse result (no 'kind' or 'records' key)")
    return data
