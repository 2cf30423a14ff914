"""Issue 32 on several GPUs of one host: the NCCL probe, the serving runs of parallel worlds, and the
exactness report. Prepared and smoke-tested on CPU (gloo); NOT yet run on a GPU.

    python3 bench/multi_gpu.py probe --out $OUT/nccl_probe.json                    # every GPU, NCCL (~30 s)
    python3 bench/multi_gpu.py serving --model glm5-faithful --layouts '1;dpep2' --presets hisparse \\
        --input-len 102400 --output-len 256 --per-gpu 47 --kv-pool-gib 27.4166 --host-pool-gib 24 \\
        --kv-cache-dtype fp8_e4m3 --out $OUT/multi_scale.json                      # issue 32 run 2
    python3 bench/multi_gpu.py serving --layouts 'pd1+1;dp2' --concurrency 16 ... # issue 32 run 3
    python3 bench/multi_gpu.py serving --quick --out /tmp/multi_smoke.json         # CPU smoke (gloo, tiny)
    python3 bench/multi_gpu.py merge A.json B.json --out AB.json                  # worlds of several runs compared
    python3 bench/multi_gpu.py exact-report --jsonl A.jsonl --junit A.xml --out $OUT/exact32.json

`serving` runs every (preset, layout) world in a child process of its own (a fresh CUDA context
and rendezvous; a hung or failed world is killed by its process group after --world-timeout and
reported, the next one still runs) and rewrites --out after each, so a call cut short keeps what
ran. Each world: build (rank 0 here, the others spawned) -> the oracle reference for +spec presets
(decoded in the world unless --reference-dir holds it) -> the prefix prepared on every rank (on
every prefill rank of a disaggregated world) -> warm-up -> a --duration window at the world's
concurrency -> close. Per rank (the same for every rank of every layout): the KV pool
(--kv-pool-gib, or --resident-fit histories) and its slots, sized as bench/gpu_serving.py sizes one
GPU (dhisparse.bench.sizing); a disaggregated world's host pool also holds its decode ranks' whole
received histories (module `host_pool_for`). --per-gpu C gives each world C x its decode GPUs
clients (the scaling comparison: the same load per GPU); --concurrency C gives every world C (the
disaggregation comparison: the same load on the same GPUs).

The result file is a bench result (`dhisparse table` reads its runs, labelled preset@layout) with
`worlds` (per-GPU output, per-rank window tokens, the TTFT split, times, rank 0's device memory),
`memory` (weights per GPU under each layout, pool, host) and `comparison` (each world's per-GPU
output against the one-GPU world's, and a disaggregated world's against the colocated world of the
same GPUs). The host's NVLink multicast stays off (dhisparse.bench.multi.multicast_off).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dhisparse.bench import multi as M  # noqa: E402

GIB = float(1 << 30)
QUICK = dict(model="tiny", device="cpu", dtype="float32", input_len=192, output_len=12, duration=1.5, per_gpu=2,
             page_size=16, distinct_suffixes=4, max_batched_tokens=512, resident_fit=2, layouts="1;dpep2;pd1+1",
             presets="hisparse,adaptive+spec", world_timeout=120.0, dist_timeout=30.0, host_pool_gib=None)
# guesses for the printed estimate (s): a world's start (spawn, CUDA context, model build) and prefill rate
BUILD_S = {"glm5-faithful": 40.0}
PREFILL_TOK_S = {"glm5-faithful": 1200.0}


# -- serving -------------------------------------------------------------------------------------

def serving_parser(sub) -> None:
    p = sub.add_parser("serving", help="closed-loop serving of parallel worlds (issue 32 runs 2 and 3)")
    a = p.add_argument
    a("--model", default="glm5-faithful"); a("--device", default="cuda"); a("--dtype", default="bfloat16")
    a("--layouts", default="1;dpep2", help="';'-separated: 1, dpN, dpepN, tpN, pdP+D, pdP+DepE")
    a("--presets", default="hisparse,adaptive,adaptive+spec")
    a("--input-len", type=int, default=102400); a("--output-len", type=int, default=256)
    a("--duration", type=float, default=30.0, help="seconds of each world's timed window")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--per-gpu", type=int, default=None, help="clients per decode GPU: each world gets C x its decode GPUs")
    g.add_argument("--concurrency", type=int, default=None, help="clients of every world (the same load on every layout)")
    a("--kv-pool-gib", type=float, default=None, help="each rank's KV pool (default: --resident-fit histories)")
    a("--resident-fit", type=int, default=3); a("--admit-factor", type=float, default=10.0)
    a("--host-pool-gib", type=float, default=None,
      help="each rank's host pool (give it on the device machines: their MemAvailable starts far below the memory they have)")
    a("--page-size", type=int, default=64); a("--hot-cache-rows", type=int, default=None)
    a("--kv-cache-dtype", default="auto"); a("--max-batched-tokens", type=int, default=8192)
    a("--spec-width", type=int, default=4); a("--spec-tokens-per-round", type=float, default=2.88)
    a("--distinct-suffixes", type=int, default=8)
    a("--cuda-graphs", default="auto", help="every world's; EP and TP worlds run without graphs whatever this says")
    a("--engine-arg", action="append", default=[], metavar="NAME=VALUE", help="another EngineConfig setting (repeatable)")
    a("--dist-timeout", type=float, default=300.0, help="--dist-timeout of every world (also bounds its start-up)")
    a("--world-timeout", type=float, default=420.0, help="seconds before a world's process group is killed")
    a("--reference-dir", default=None, help="oracle references kept here between calls (default: decoded in each world)")
    a("--quick", action="store_true", help="CPU smoke: tiny, gloo, 2 processes a world, seconds (QUICK)")
    a("--out", required=True)
    p.set_defaults(func=serving, defaults={k: p.get_default(k) for k in QUICK})


def parse_serving(ns) -> argparse.Namespace:
    if ns.quick:  # QUICK's values where the command line left the default (an explicit flag wins)
        for k, v in QUICK.items():
            if getattr(ns, k) == ns.defaults[k] and (k != "per_gpu" or ns.concurrency is None):
                setattr(ns, k, v)
    if ns.per_gpu is None and ns.concurrency is None:
        ns.per_gpu = 8
    ns.layout_list = [M.parse_layout(t) for t in ns.layouts.split(";") if t.strip()]
    ns.preset_list = [p.strip() for p in ns.presets.split(",") if p.strip()]
    return ns


def model_config(name: str):
    """The ModelConfig of a built-in random model, or of a folder / the shipped tiny-code."""
    from dhisparse.bench.sizing import model_config as builtin
    from dhisparse.core.config import ModelConfig
    from dhisparse.models.registry import resolve_folder

    try:
        return builtin(name)
    except KeyError:
        return ModelConfig.from_hf(json.loads((resolve_folder(name) / "config.json").read_text()))


def rank_sizing(ns, cfg) -> dict:
    """One rank's pool, slots and host pool: bench/gpu_serving.py's sizing of one GPU."""
    from dhisparse.bench.sizing import GIB as G, resident_fit_for, sizing

    s = argparse.Namespace(**vars(ns))
    if ns.kv_pool_gib:
        s.resident_fit = resident_fit_for(s, cfg, int(ns.kv_pool_gib * G))
    return sizing(s, cfg)


def clients(ns, layout: M.Layout) -> int:
    return ns.concurrency if ns.concurrency is not None else ns.per_gpu * layout.decode_gpus


def host_pool_for(ns, sz: dict, layout: M.Layout) -> int:
    """A rank's host pool: the sizing's (the shared prefix once + each slot's own pages), or for a
    disaggregated world's decode ranks what they need for whole histories (its prefill ranks:
    `prefill_host_pool_for`): KV arrives as rows of the
    whole prompt, which a host-first admission keeps on the host for each session (no shared
    prefix pages there): ceil(1.25 x clients / D) histories + the prefix (prefill ranks' copy)."""
    if ns.host_pool_gib:
        return int(ns.host_pool_gib * GIB)
    if layout.kind != "pd":
        return sz["host_pool_bytes"]
    from dhisparse.bench.sizing import resident_bytes

    sessions = math.ceil(1.25 * clients(ns, layout) / layout.decode)
    return max(sz["host_pool_bytes"], sz["host_shared_prefix_bytes"] + sessions * resident_bytes(sz))


def prefill_host_pool_for(ns, sz: dict, layout: M.Layout) -> int | None:
    """A disaggregated world's prefill ranks' host pool (None elsewhere): the colocated sizing's (the
    shared prefix once + each slot's own pages), since a prefill rank holds only its in-flight
    prompts and sends their KV on (`--disaggregation-prefill-host-pool-bytes`); --host-pool-gib sets
    every rank's."""
    if layout.kind != "pd":
        return None
    return int(ns.host_pool_gib * GIB) if ns.host_pool_gib else sz["host_pool_bytes"]


def world_host_gib(ns, sz: dict, layout: M.Layout) -> float:
    """Host pool GiB the whole world pins: per rank, and per role in a disaggregated world."""
    pre = prefill_host_pool_for(ns, sz, layout)
    if pre is None:
        return layout.gpus * host_pool_for(ns, sz, layout) / GIB
    return (layout.prefill * pre + layout.decode * host_pool_for(ns, sz, layout)) / GIB


def engine_kwargs(ns, sz: dict, preset: str, layout: M.Layout) -> dict:
    """Every EngineConfig field of one world (JSON-able: the child process builds its config from it)."""
    from gpu_serving import engine_overrides

    spec = preset.endswith("+spec")
    base = dict(model=ns.model, preset=preset, device=ns.device, dtype=ns.dtype, page_size=ns.page_size,
                kv_pool_bytes=sz["kv_pool_bytes"], max_running_requests=sz["max_running_requests"],
                max_num_batched_tokens=ns.max_batched_tokens, hot_cache_rows=ns.hot_cache_rows,
                host_pool_bytes=host_pool_for(ns, sz, layout), max_model_len=sz["tokens_per_request"] + 8,
                speculative_algorithm="oracle" if spec else None, speculative_num_draft_tokens=ns.spec_width,
                speculative_oracle_tokens_per_round=ns.spec_tokens_per_round if spec else None,
                cuda_graphs=ns.cuda_graphs, kv_cache_dtype=ns.kv_cache_dtype, dist_timeout_s=ns.dist_timeout)
    pre = prefill_host_pool_for(ns, sz, layout)
    if pre is not None:
        base["disaggregation_prefill_host_pool_bytes"] = pre
    return base | layout.engine_fields() | engine_overrides(ns.engine_arg)


def memory_rows(ns, sz: dict) -> list[dict]:
    """Per layout: weights a GPU holds (routed experts split under EP), the KV pool and host pool a rank holds."""
    rows = []
    for layout in ns.layout_list:
        ep = layout.gpus if layout.kind == "dpep" else layout.ep
        w = M.weight_bytes_per_gpu(ns.model, ep)
        rows.append({"layout": layout.name, "ep": ep, "weights_per_gpu_gib": w and w["per_gpu"] / GIB,
                     "weights_total_gib": w and w["total"] / GIB, "routed_experts_gib": w and w["routed_experts"] / GIB,
                     "kv_pool_gib": sz["kv_pool_bytes"] / GIB, "host_pool_gib_per_rank": host_pool_for(ns, sz, layout) / GIB,
                     "host_pool_gib_per_prefill_rank": (lambda b: b and b / GIB)(prefill_host_pool_for(ns, sz, layout)),
                     "host_pool_gib_world": world_host_gib(ns, sz, layout),
                     "device_gib_per_gpu_before_activations": w and (w["per_gpu"] + sz["kv_pool_bytes"]) / GIB})
    return rows


def estimate_s(ns, layout: M.Layout, preset: str) -> float:
    """A rough guess of one world's wall time (printed before it runs; unmeasured rates)."""
    if ns.quick:
        return 10 + ns.duration
    build = BUILD_S.get(ns.model, 20.0)
    prefill = ns.input_len / PREFILL_TOK_S.get(ns.model, 5000.0)
    ref = ns.output_len * 0.15 if preset.endswith("+spec") and not ns.reference_dir else 0.0
    warm = 10 + clients(ns, layout) / layout.decode_gpus * 0.5
    return build + prefill + ref + warm + ns.duration + 10


def reference_for(ns, layout: M.Layout, preset: str, tmp: Path) -> dict | None:
    """(path, key) of a +spec world's oracle reference; None for other presets."""
    from dhisparse.bench.results import source_commit

    if not preset.endswith("+spec"):
        return None
    key = {"model": ns.model, "dtype": ns.dtype, "kv_cache_dtype": ns.kv_cache_dtype, "input_len": ns.input_len,
           "output_len": ns.output_len, "distinct_suffixes": ns.distinct_suffixes, "layout": layout.name,
           "commit": source_commit()}
    folder = Path(ns.reference_dir) if ns.reference_dir else tmp
    name = f"oracle_ref_{ns.model}_{layout.name.replace('+', 'p')}_{ns.input_len}_{ns.output_len}.json"
    return {"path": str(folder / name), "key": key}


def run_child(spec: dict, tmp: Path, timeout_s: float) -> dict:
    """One world in a child process (its own session: the whole group is killed past the timeout)."""
    tag = f"{spec['preset'].replace('+', '_')}_{spec['layout'].replace('+', 'p')}"
    spec_path, part, log = tmp / f"{tag}.spec.json", tmp / f"{tag}.part.json", tmp / f"{tag}.log"
    spec_path.write_text(json.dumps(spec))
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_world", str(spec_path), str(part)],
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


def comparison(worlds: list[dict]) -> list[dict]:
    """Per preset: each world's per-GPU output over the one-GPU world's, and each disaggregated
    world's per-decode-GPU output and TTFT split beside the colocated world of the same GPUs."""
    ok = [w for w in worlds if "error" not in w]
    rows = []
    for w in ok:
        lay, preset, pg = w["layout"], w["preset"], w["per_gpu"]
        one = next((b for b in ok if b["preset"] == preset and b["layout"]["kind"] == "one"), None)
        row = {"preset": preset, "layout": lay["name"], "gpus": lay["gpus"], "clients": w["concurrency"],
               "output_tok_s": pg["output_tok_s"], "per_gpu": pg["output_tok_s_per_gpu"],
               "per_decode_gpu": pg["output_tok_s_per_decode_gpu"],
               "allocation_wait_s": w["ttft_split"]["all"]["allocation_s"], "handoff_s": w["ttft_split"]["all"]["handoff_s"],
               "ttft_s": w["ttft_split"]["all"]["ttft_s"]}
        if one is not None and lay["kind"] != "one" and one["per_gpu"]["output_tok_s_per_gpu"]:
            row["per_gpu_vs_one_gpu"] = pg["output_tok_s_per_gpu"] / one["per_gpu"]["output_tok_s_per_gpu"]
        if lay["kind"] == "pd":
            same = [b for b in ok if b["preset"] == preset and b["layout"]["kind"] in ("dp", "dpep")
                    and b["layout"]["gpus"] == lay["gpus"]]  # colocated on the same GPUs; EP where the roles have it
            want = "dpep" if lay.get("ep", 1) > 1 else "dp"
            co = next((b for b in same if b["layout"]["kind"] == want), same[0] if same else None)
            if co is not None and co["per_gpu"]["output_tok_s_per_gpu"]:
                row["colocated"] = co["layout"]["name"]
                row["per_decode_gpu_vs_colocated_per_gpu"] = (pg["output_tok_s_per_decode_gpu"]
                                                              / co["per_gpu"]["output_tok_s_per_gpu"])
                row["output_vs_colocated"] = pg["output_tok_s"] / co["per_gpu"]["output_tok_s"] if co["per_gpu"]["output_tok_s"] else None
        rows.append(row)
    return rows


def print_comparison(rows: list[dict]) -> None:
    for row in rows:
        ratios = {k: round(v, 3) for k, v in row.items() if k.endswith(("vs_one_gpu", "vs_colocated_per_gpu", "vs_colocated")) and v}
        print(f"[compare] {row['preset']:14} {row['layout']:9} per GPU {row['per_gpu']:.1f}  {ratios}", flush=True)


def write_result(ns, sz: dict, worlds: list[dict], t0: float) -> Path:
    from dhisparse.bench import results as R
    from dhisparse.engine.config import AVAILABLE_PRESETS, PRESETS

    runs = []
    for w in worlds:
        if "run" in w:
            run = dict(w["run"], preset=f"{w['preset']}@{w['layout']['name']}")
            runs.append(run)
    slim = [{k: v for k, v in w.items() if k != "run"} for w in worlds]
    config = {"engine": {"model": ns.model, "dtype": ns.dtype, "device": ns.device, "kv_cache_dtype": ns.kv_cache_dtype,
                         "page_size": ns.page_size, "cuda_graphs": ns.cuda_graphs, "engine_args": ns.engine_arg},
              "workload": {"input_len": ns.input_len, "output_len": ns.output_len, "duration_s": ns.duration,
                           "distinct_suffixes": ns.distinct_suffixes},
              "load": {"per_gpu": ns.per_gpu, "concurrency": ns.concurrency},
              "layouts": [{"name": l.name, "flags": l.flags(), "gpus": l.gpus} for l in ns.layout_list],
              "presets": ns.preset_list, "rank_sizing": sz, "wall_s": time.perf_counter() - t0}
    notes = ["each world ran in its own process; per-GPU output = window output tokens / duration / GPUs",
             "EP and TP worlds run without CUDA graphs (their exchanges are collectives); see config.engine.cuda_graphs for the others"]
    if any(p.endswith("+spec") for p in ns.preset_list):
        notes.append(f"+spec presets use the ORACLE drafter (measurement tool), calibrated to {ns.spec_tokens_per_round} "
                     f"tokens/round at width {ns.spec_width}; drafting is free (no drafter network runs)")
    data = {"schema_version": R.SCHEMA_VERSION, "kind": "bench", "date": R.now_iso(), "commit": R.source_commit(),
            "command": R.command_line(ns.argv), "machine": R.machine_info(), "env": {k: os.environ.get(k) for k in M.MULTICAST_OFF},
            "config": config, "available_presets": list(AVAILABLE_PRESETS),
            "unavailable_presets": [p for p in PRESETS if p not in AVAILABLE_PRESETS], "notes": notes,
            "memory": memory_rows(ns, sz), "runs": runs, "worlds": slim, "comparison": comparison(worlds)}
    path = Path(ns.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(R._clean(data), indent=1, allow_nan=False) + "\n")
    return path


_CHILD: list = []  # the world's child process now running (killed with its group if this process is stopped)


def _stop(signum, frame) -> None:
    """SIGTERM / SIGINT (an outer `timeout`): the running world's process group goes too, then exit."""
    for proc in _CHILD:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    raise SystemExit(128 + signum)


def serving(ns) -> int:
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    env = M.multicast_off()
    from dhisparse.bench.sizing import describe

    cfg = model_config(ns.model)
    sz = rank_sizing(ns, cfg)
    print(f"[env] {env}", flush=True)
    print(f"[sizing] each rank: {describe(sz)}", flush=True)
    for row in memory_rows(ns, sz):
        print(f"[memory] {row['layout']}: weights/GPU {row['weights_per_gpu_gib'] or 0:.1f} GiB + pool "
              f"{row['kv_pool_gib']:.1f} GiB = {row['device_gib_per_gpu_before_activations'] or 0:.1f} GiB before "
              f"activations; host pool/rank {row['host_pool_gib_per_rank']:.1f} GiB", flush=True)
    plan = [(p, l) for p in ns.preset_list for l in ns.layout_list]
    total = sum(estimate_s(ns, l, p) for p, l in plan)
    print(f"[budget] {len(plan)} worlds, estimated {total:.0f} s (rough; each world cut at {ns.world_timeout:.0f} s)", flush=True)
    t0, worlds = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="multi_gpu_") as tmp:
        for preset, layout in plan:
            c = clients(ns, layout)
            spec = {"layout": layout.name, "preset": preset, "engine": engine_kwargs(ns, sz, preset, layout),
                    "workload": {"input_len": ns.input_len, "output_len": ns.output_len, "duration_s": ns.duration},
                    "concurrency": c, "distinct": ns.distinct_suffixes,
                    "reference": reference_for(ns, layout, preset, Path(tmp))}
            print(f"[world] {preset} on {layout.name} ({layout.flags() or 'one GPU'}), C{c}, "
                  f"estimate {estimate_s(ns, layout, preset):.0f} s", flush=True)
            w = run_child(spec, Path(tmp), ns.world_timeout)
            worlds.append(w)
            if "error" in w:
                print(f"[world] {preset} {layout.name} FAILED: {w['error']}", flush=True)
            else:
                pg, sp = w["per_gpu"], w["ttft_split"]["all"]
                print(f"[world] {preset:14} {layout.name:9} {pg['output_tok_s']:9.1f} tok/s  {pg['output_tok_s_per_gpu']:8.1f}"
                      f"/GPU  {pg['output_tok_s_per_decode_gpu']:8.1f}/decode GPU  TTFT {sp['ttft_s']}  alloc {sp['allocation_s']}"
                      f"  hand-off {sp['handoff_s']}  ranks {w['rank_window_tokens']}  ({w['times']['child_wall_s']:.0f} s)", flush=True)
            path = write_result(ns, sz, worlds, t0)
    print_comparison(comparison(worlds))
    print(f"[done] {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if all("error" not in w for w in worlds) else 1


def merge_parser(sub) -> None:
    p = sub.add_parser("merge", help="serving result files of one model and workload -> one file, compared again "
                                     "(worlds run side by side on disjoint GPUs, or in several calls)")
    p.add_argument("files", nargs="+"); p.add_argument("--out", required=True)
    p.set_defaults(func=merge)


def merge(ns) -> int:
    """Runs, worlds and memory rows of every file (the first file's header), `comparison` over all
    worlds; refused when the files' model or workload differ."""
    from dhisparse.bench import results as R

    datas = [json.loads(Path(f).read_text()) for f in ns.files]
    first = datas[0]
    for f, d in zip(ns.files[1:], datas[1:]):
        for key in ("engine", "workload"):
            a, b = dict(first["config"][key]), dict(d["config"][key])
            if key == "engine":  # graphs may differ by world; the model and rows may not
                a, b = ({k: v for k, v in x.items() if k != "cuda_graphs"} for x in (a, b))
            if a != b:
                raise SystemExit(f"{f}: config.{key} {b} differs from {ns.files[0]}'s {a}")
    out = dict(first, command=R.command_line(ns.argv), merged_from=[{"file": Path(f).name, "command": d["command"],
                                                                     "date": d["date"], "commit": d["commit"]}
                                                                    for f, d in zip(ns.files, datas)])
    out["runs"] = [r for d in datas for r in d["runs"]]
    out["worlds"] = [w for d in datas for w in d["worlds"]]
    out["memory"] = [m for d in datas for m in d["memory"]]
    out["notes"] = list(dict.fromkeys(n for d in datas for n in d["notes"]))
    out["comparison"] = comparison(out["worlds"])
    Path(ns.out).write_text(json.dumps(R._clean(out), indent=1, allow_nan=False) + "\n")
    print_comparison(out["comparison"])
    return 0


# -- the NCCL probe --------------------------------------------------------------------------------

def probe_parser(sub) -> None:
    p = sub.add_parser("probe", help="NCCL (gloo on CPU) collectives and point-to-point on every GPU, checked and timed")
    p.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU; 2 on CPU)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--mib", type=int, default=256, help="payload of the timed all-reduce and send")
    p.add_argument("--out", required=True)
    p.set_defaults(func=probe)


def _probe_rank(rank: int, world: int, addr: str, device: str, mib: int, q) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    res: dict = {}

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    try:
        t = torch.full((4,), rank + 1, dtype=torch.int64, device=dev)
        dist.all_reduce(t)
        res["all_reduce_ok"] = t.tolist() == [world * (world + 1) // 2] * 4
        send = [r + 1 for r in range(world)]  # rank -> r gets r + 1 rows of value 100 * rank + r
        rows = torch.cat([torch.full((n, 3), 100 * rank + r, dtype=torch.float32, device=dev) for r, n in enumerate(send)])
        recv = [rank + 1] * world
        got = torch.empty(sum(recv), 3, dtype=torch.float32, device=dev)
        dist.all_to_all_single(got, rows, recv, send)
        want = torch.cat([torch.full((rank + 1, 3), 100 * s + rank, dtype=torch.float32, device=dev) for s in range(world)])
        res["all_to_all_uneven_ok"] = bool(torch.equal(got, want))
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        out, inb = torch.full((5,), float(rank), device=dev), torch.empty(5, device=dev)
        works = [dist.isend(out, nxt, tag=7), dist.irecv(inb, prv, tag=7)]
        for w in works:
            w.wait(timeout=datetime.timedelta(seconds=60))
        sync()
        res["p2p_ring_ok"] = bool((inb == prv).all())
        n = mib * (1 << 20) // 2
        big = torch.ones(n, dtype=torch.bfloat16, device=dev)
        dist.all_reduce(big)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(big)
        sync()
        s = (time.perf_counter() - t0) / 5
        res["all_reduce_ms"] = 1e3 * s
        res["all_reduce_busbw_gbs"] = 2 * (world - 1) / world * n * 2 / s / 1e9
        if world >= 2 and rank in (0, 1):  # one pair's point-to-point (the KV hand-off's path)
            peer = 1 - rank
            for i in range(4):
                t0 = time.perf_counter()
                w = dist.isend(big, peer) if rank == 0 else dist.irecv(big, peer)
                w.wait(timeout=datetime.timedelta(seconds=60))
                sync()
                if i:
                    res.setdefault("p2p_ms", []).append(1e3 * (time.perf_counter() - t0))
            res["p2p_gbs"] = n * 2 / (min(res["p2p_ms"]) / 1e3) / 1e9
        dist.barrier()
        parts = [None] * world
        dist.all_gather_object(parts, res)
        if rank == 0:
            q.put(parts)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the probe must return
        q.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def probe(ns) -> int:
    import multiprocessing as mp

    import torch

    from dhisparse.bench import results as R
    from dhisparse.engine.rank_spawn import free_addr

    env = M.multicast_off()
    cuda = ns.device == "cuda"
    world = ns.gpus or (torch.cuda.device_count() if cuda else 2)
    info = {"nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "NVSHMEM_", "TORCH_SYMM"))}}
    for cmd in (["nvidia-smi", "topo", "-m"], ["df", "-h", "/dev/shm"]):
        try:
            info[" ".join(cmd)] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            info[" ".join(cmd)] = f"unavailable: {e}"
    ctx, addr = mp.get_context("spawn"), free_addr()
    q = ctx.Queue()
    procs = [ctx.Process(target=_probe_rank, args=(r, world, addr, ns.device, ns.mib, q)) for r in range(world)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    try:
        ranks = q.get(timeout=300)
    except Exception as e:  # noqa: BLE001
        ranks = f"no answer: {type(e).__name__}"
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    ok = isinstance(ranks, list) and all(r.get("all_reduce_ok") and r.get("all_to_all_uneven_ok") and r.get("p2p_ring_ok")
                                         for r in ranks)
    data = {"kind": "nccl_probe", "date": R.now_iso(), "commit": R.source_commit(), "command": R.command_line(ns.argv),
            "machine": R.machine_info(), "env": env, "world": world, "device": ns.device, "ok": ok,
            "wall_s": time.perf_counter() - t0, "ranks": ranks, "info": info}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(R._clean(data), indent=1) + "\n")
    print(f"[probe] world {world} on {ns.device}: {'ok' if ok else 'FAILED'}; {ranks if not ok else ranks[0]}", flush=True)
    return 0 if ok else 1


# -- the exactness report --------------------------------------------------------------------------

def exact_parser(sub) -> None:
    p = sub.add_parser("exact-report", help="tests/test_parallel_cuda.py's records (JSON lines) and JUnit files -> one result")
    p.add_argument("--jsonl", nargs="*", default=[]); p.add_argument("--junit", nargs="*", default=[])
    p.add_argument("--junit-out", default=None, help="the JUnit files merged into one")
    p.add_argument("--out", required=True)
    p.set_defaults(func=exact_report)


def exact_report(ns) -> int:
    import xml.etree.ElementTree as ET

    from dhisparse.bench import results as R

    cases = []
    for path in ns.jsonl:
        if Path(path).exists():
            cases += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    junit = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.Element("testsuites")
    for path in ns.junit:
        if not Path(path).exists():
            continue
        tree = ET.parse(path).getroot()
        for suite in ([tree] if tree.tag == "testsuite" else list(tree)):
            root.append(suite)
            for k in junit:
                junit[k] += int(suite.get(k, 0))
    if ns.junit_out:
        ET.ElementTree(root).write(ns.junit_out, encoding="utf-8", xml_declaration=True)
    equal = sum(c.get("equal", False) for c in cases)
    data = {"kind": "exact32", "date": R.now_iso(), "commit": R.source_commit(), "command": R.command_line(ns.argv),
            "machine": R.machine_info(), "env": {k: os.environ.get(k) for k in M.MULTICAST_OFF},
            "summary": {"cases": len(cases), "equal": equal, "diverged": len(cases) - equal,
                        "ties": sum(any(d.get("tie") for d in c.get("diverged", [])) for c in cases), "junit": junit},
            "cases": cases}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(R._clean(data), indent=1) + "\n")
    print(f"[exact] {equal} of {len(cases)} worlds token-identical to one GPU; junit {junit}", flush=True)
    return 0 if equal == len(cases) and not junit["failures"] and not junit["errors"] else 1


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line (a subcommand's namespace; `serving`'s completed by `parse_serving`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    serving_parser(sub)
    merge_parser(sub)
    probe_parser(sub)
    exact_parser(sub)
    ns = p.parse_args(argv)
    ns.argv = ["bench/multi_gpu.py", *argv]
    return parse_serving(ns) if ns.func is serving else ns


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_world"]:
        return world_main(argv[1], argv[2])
    ns = parse(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
