"""The result files of parallel worlds (issue 32; bench/multi_gpu.py `serving` and `merge`).

    serving_result   a bench result (`dhisparse table` reads its runs, labelled preset@layout) with
                     `worlds`, `memory` and `comparison`
    merge_results    several such files of one model and workload -> one, compared again
    comparison       per preset: each world's per-GPU output against the one-GPU world's, and a
                     disaggregated world's against the colocated world of the same GPUs
    write_data       a result dict as indented JSON (its folder made)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dhisparse.bench import results as R
from dhisparse.bench.multi import MULTICAST_OFF
from dhisparse.bench.multi_sizing import memory_rows


def write_data(path: str | Path, data: dict, allow_nan: bool = True) -> Path:
    """`data` (cleaned: `results._clean`) as indented JSON at `path`, its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(R._clean(data), indent=1, allow_nan=allow_nan) + "\n")
    return path


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
            row.update(_against_colocated(ok, w))
        rows.append(row)
    return rows


def _against_colocated(ok: list[dict], w: dict) -> dict:
    """A disaggregated world's output against the colocated world of the same GPUs (EP where its roles have it)."""
    lay, preset, pg = w["layout"], w["preset"], w["per_gpu"]
    same = [b for b in ok if b["preset"] == preset and b["layout"]["kind"] in ("dp", "dpep")
            and b["layout"]["gpus"] == lay["gpus"]]
    want = "dpep" if lay.get("ep", 1) > 1 else "dp"
    co = next((b for b in same if b["layout"]["kind"] == want), same[0] if same else None)
    if co is None or not co["per_gpu"]["output_tok_s_per_gpu"]:
        return {}
    return {"colocated": co["layout"]["name"],
            "per_decode_gpu_vs_colocated_per_gpu": pg["output_tok_s_per_decode_gpu"] / co["per_gpu"]["output_tok_s_per_gpu"],
            "output_vs_colocated": pg["output_tok_s"] / co["per_gpu"]["output_tok_s"] if co["per_gpu"]["output_tok_s"] else None}


def print_comparison(rows: list[dict]) -> None:
    for row in rows:
        ratios = {k: round(v, 3) for k, v in row.items() if k.endswith(("vs_one_gpu", "vs_colocated_per_gpu", "vs_colocated")) and v}
        print(f"[compare] {row['preset']:14} {row['layout']:9} per GPU {row['per_gpu']:.1f}  {ratios}", flush=True)


def serving_result(ns, sz: dict, worlds: list[dict], wall_s: float) -> dict:
    """The `serving` result of the worlds run so far (each world's run under preset@layout)."""
    from dhisparse.engine.config import AVAILABLE_PRESETS, PRESETS

    runs = [dict(w["run"], preset=f"{w['preset']}@{w['layout']['name']}") for w in worlds if "run" in w]
    slim = [{k: v for k, v in w.items() if k != "run"} for w in worlds]
    config = {"engine": {"model": ns.model, "dtype": ns.dtype, "device": ns.device, "kv_cache_dtype": ns.kv_cache_dtype,
                         "page_size": ns.page_size, "cuda_graphs": ns.cuda_graphs, "engine_args": ns.engine_arg},
              "workload": {"input_len": ns.input_len, "output_len": ns.output_len, "duration_s": ns.duration,
                           "distinct_suffixes": ns.distinct_suffixes},
              "load": {"per_gpu": ns.per_gpu, "concurrency": ns.concurrency},
              "layouts": [{"name": l.name, "flags": l.flags(), "gpus": l.gpus} for l in ns.layout_list],
              "presets": ns.preset_list, "rank_sizing": sz, "wall_s": wall_s}
    notes = ["each world ran in its own process; per-GPU output = window output tokens / duration / GPUs",
             "EP and TP worlds run without CUDA graphs (their exchanges are collectives); see config.engine.cuda_graphs for the others"]
    if any(p.endswith("+spec") for p in ns.preset_list):
        notes.append(f"+spec presets use the ORACLE drafter (measurement tool), calibrated to {ns.spec_tokens_per_round} "
                     f"tokens/round at width {ns.spec_width}; drafting is free (no drafter network runs)")
    return {"schema_version": R.SCHEMA_VERSION, "kind": "bench", "date": R.now_iso(), "commit": R.source_commit(),
            "command": R.command_line(ns.argv), "machine": R.machine_info(), "env": multicast_env(),
            "config": config, "available_presets": list(AVAILABLE_PRESETS),
            "unavailable_presets": [p for p in PRESETS if p not in AVAILABLE_PRESETS], "notes": notes,
            "memory": memory_rows(ns, sz), "runs": runs, "worlds": slim, "comparison": comparison(worlds)}


def multicast_env() -> dict:
    """The multicast variables as this process has them (a result's `env`)."""
    return {k: os.environ.get(k) for k in MULTICAST_OFF}


def merge_results(files: list[str], datas: list[dict], argv: list[str]) -> dict:
    """Runs, worlds and memory rows of every file (the first file's header), `comparison` over all
    worlds; SystemExit when the files' model or workload differ."""
    first = datas[0]
    for f, d in zip(files[1:], datas[1:]):
        for key in ("engine", "workload"):
            a, b = dict(first["config"][key]), dict(d["config"][key])
            if key == "engine":  # graphs may differ by world; the model and rows may not
                a, b = ({k: v for k, v in x.items() if k != "cuda_graphs"} for x in (a, b))
            if a != b:
                raise SystemExit(f"{f}: config.{key} {b} differs from {files[0]}'s {a}")
    out = dict(first, command=R.command_line(argv), merged_from=[{"file": Path(f).name, "command": d["command"],
                                                                  "date": d["date"], "commit": d["commit"]}
                                                                 for f, d in zip(files, datas)])
    out["runs"] = [r for d in datas for r in d["runs"]]
    out["worlds"] = [w for d in datas for w in d["worlds"]]
    out["memory"] = [m for d in datas for m in d["memory"]]
    out["notes"] = list(dict.fromkeys(n for d in datas for n in d["notes"]))
    out["comparison"] = comparison(out["worlds"])
    return out
