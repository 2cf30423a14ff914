"""bench/multi_gpu.py `probe` and `exact-report`: the checks of a machine of several GPUs (issue 32).

    probe          NCCL (gloo on CPU) collectives and point-to-point on every GPU, checked and timed
                   (dhisparse.bench.nccl_probe), with the host's NCCL version, topology and /dev/shm
    exact-report   tests/test_parallel_cuda.py's records (JSON lines, one a world) and JUnit files -> one
                   result (run 1: every parallel world token-identical to one GPU)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dhisparse.bench import multi as M
from dhisparse.bench.multi_report import multicast_env, write_data


def probe_parser(sub) -> None:
    p = sub.add_parser("probe", help="NCCL (gloo on CPU) collectives and point-to-point on every GPU, checked and timed")
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU; 2 on CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--mib", type=int, default=256, help="payload of the timed all-reduce and send")
    p.add_argument("--out", required=True)
    p.set_defaults(func=probe)


def probe(ns) -> int:
    import torch

    from dhisparse.bench import results as R
    from dhisparse.bench.nccl_probe import host_info, probe_ok, run_probe

    env = M.multicast_off()
    cuda = ns.device == "cuda"
    world = ns.gpus or (torch.cuda.device_count() if cuda else 2)
    info = host_info(cuda)
    t0 = time.perf_counter()
    ranks = run_probe(world, ns.device, ns.mib)
    ok = probe_ok(ranks)
    data = {"kind": "nccl_probe", "date": R.now_iso(), "commit": R.source_commit(), "command": R.command_line(ns.argv),
            "machine": R.machine_info(), "env": env, "world": world, "device": ns.device, "ok": ok,
            "wall_s": time.perf_counter() - t0, "ranks": ranks, "info": info}
    write_data(ns.out, data)
    print(f"[probe] world {world} on {ns.device}: {'ok' if ok else 'FAILED'}; {ranks if not ok else ranks[0]}", flush=True)
    return 0 if ok else 1


def exact_parser(sub) -> None:
    p = sub.add_parser("exact-report", help="tests/test_parallel_cuda.py's records (JSON lines) and JUnit files -> one result")
    p.add_argument("--jsonl", nargs="*", default=[]); p.add_argument("--junit", nargs="*", default=[])
    p.add_argument("--junit-out", default=None, help="the JUnit files merged into one")
    p.add_argument("--out", required=True)
    p.set_defaults(func=exact_report)


def read_cases(paths: list[str]) -> list[dict]:
    """Every record of the JSON-lines files that exist."""
    cases = []
    for path in paths:
        if Path(path).exists():
            cases += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return cases


def merge_junit(paths: list[str], out: str | None) -> dict:
    """The JUnit files that exist: their suites' counts summed, and the suites written to `out` as one file."""
    import xml.etree.ElementTree as ET

    junit = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.Element("testsuites")
    for path in paths:
        if not Path(path).exists():
            continue
        tree = ET.parse(path).getroot()
        for suite in ([tree] if tree.tag == "testsuite" else list(tree)):
            root.append(suite)
            for k in junit:
                junit[k] += int(suite.get(k, 0))
    if out:
        ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
    return junit


def exact_report(ns) -> int:
    from dhisparse.bench import results as R

    cases = read_cases(ns.jsonl)
    junit = merge_junit(ns.junit, ns.junit_out)
    equal = sum(c.get("equal", False) for c in cases)
    data = {"kind": "exact32", "date": R.now_iso(), "commit": R.source_commit(), "command": R.command_line(ns.argv),
            "machine": R.machine_info(), "env": multicast_env(),
            "summary": {"cases": len(cases), "equal": equal, "diverged": len(cases) - equal,
                        "ties": sum(any(d.get("tie") for d in c.get("diverged", [])) for c in cases), "junit": junit},
            "cases": cases}
    write_data(ns.out, data)
    print(f"[exact] {equal} of {len(cases)} worlds token-identical to one GPU; junit {junit}", flush=True)
    return 0 if equal == len(cases) and not junit["failures"] and not junit["errors"] else 1
