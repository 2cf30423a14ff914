"""bench/multi_gpu.py `serving` and `merge`: closed-loop serving of parallel worlds (issue 32 runs 2
and 3) and the merging of such results.

`serving` runs every (preset, layout) world in a child process of its own (bench/multi_world.py) and
rewrites --out after each (dhisparse.bench.multi_report.serving_result), so a call cut short keeps
what ran. Each rank is sized by dhisparse.bench.multi_sizing; `engine_kwargs` gives a world's
EngineConfig fields, `reference_for` a +spec world's oracle reference file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.multi_world import run_child, stop_children_on_signals
from dhisparse.bench import multi as M
from dhisparse.bench.multi_report import comparison, merge_results, print_comparison, serving_result, write_data
from dhisparse.bench.multi_sizing import clients, estimate_s, host_pool_for, memory_rows, model_config, \
    prefill_host_pool_for, rank_sizing

QUICK = dict(model="tiny", device="cpu", dtype="float32", input_len=192, output_len=12, duration=1.5, per_gpu=2,
             page_size=16, distinct_suffixes=4, max_batched_tokens=512, resident_fit=2, layouts="1;dpep2;pd1+1",
             presets="hisparse,adaptive+spec", world_timeout=120.0, dist_timeout=30.0, host_pool_gib=None)


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


def engine_kwargs(ns, sz: dict, preset: str, layout: M.Layout) -> dict:
    """Every EngineConfig field of one world (JSON-able: the child process builds its config from it)."""
    from bench.gpu_serving import engine_overrides

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


def reference_for(ns, layout: M.Layout, preset: str, tmp: Path) -> dict | None:
    """(path, key) of a +spec world's oracle reference (dhisparse.bench.reference's key and the
    world's layout); None for other presets."""
    from dhisparse.bench.reference import reference_key

    if not preset.endswith("+spec"):
        return None
    key = reference_key(ns.model, ns.dtype, ns.kv_cache_dtype, ns.input_len, ns.output_len,
                        ns.distinct_suffixes) | {"layout": layout.name}
    folder = Path(ns.reference_dir) if ns.reference_dir else tmp
    name = f"oracle_ref_{ns.model}_{layout.name.replace('+', 'p')}_{ns.input_len}_{ns.output_len}.json"
    return {"path": str(folder / name), "key": key}


def world_spec(ns, sz: dict, preset: str, layout: M.Layout, tmp: Path) -> dict:
    """What the world's child process reads: its EngineConfig fields, workload, clients and reference."""
    return {"layout": layout.name, "preset": preset, "engine": engine_kwargs(ns, sz, preset, layout),
            "workload": {"input_len": ns.input_len, "output_len": ns.output_len, "duration_s": ns.duration},
            "concurrency": clients(ns, layout), "distinct": ns.distinct_suffixes,
            "reference": reference_for(ns, layout, preset, tmp)}


def print_plan(ns, sz: dict, plan: list) -> None:
    """The environment, each rank's sizing, each layout's memory and the worlds' estimated time."""
    from dhisparse.bench.sizing import describe

    print(f"[sizing] each rank: {describe(sz)}", flush=True)
    for row in memory_rows(ns, sz):
        print(f"[memory] {row['layout']}: weights/GPU {row['weights_per_gpu_gib'] or 0:.1f} GiB + pool "
              f"{row['kv_pool_gib']:.1f} GiB = {row['device_gib_per_gpu_before_activations'] or 0:.1f} GiB before "
              f"activations; host pool/rank {row['host_pool_gib_per_rank']:.1f} GiB", flush=True)
    total = sum(estimate_s(ns, l, p) for p, l in plan)
    print(f"[budget] {len(plan)} worlds, estimated {total:.0f} s (rough; each world cut at {ns.world_timeout:.0f} s)", flush=True)


def print_world(preset: str, layout: M.Layout, w: dict) -> None:
    if "error" in w:
        print(f"[world] {preset} {layout.name} FAILED: {w['error']}", flush=True)
        return
    pg, sp = w["per_gpu"], w["ttft_split"]["all"]
    print(f"[world] {preset:14} {layout.name:9} {pg['output_tok_s']:9.1f} tok/s  {pg['output_tok_s_per_gpu']:8.1f}"
          f"/GPU  {pg['output_tok_s_per_decode_gpu']:8.1f}/decode GPU  TTFT {sp['ttft_s']}  alloc {sp['allocation_s']}"
          f"  hand-off {sp['handoff_s']}  ranks {w['rank_window_tokens']}  ({w['times']['child_wall_s']:.0f} s)", flush=True)


def serving(ns) -> int:
    stop_children_on_signals()
    env = M.multicast_off()
    cfg = model_config(ns.model)
    sz = rank_sizing(ns, cfg)
    print(f"[env] {env}", flush=True)
    plan = [(p, l) for p in ns.preset_list for l in ns.layout_list]
    print_plan(ns, sz, plan)
    t0, worlds = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="multi_gpu_") as tmp:
        for preset, layout in plan:
            spec = world_spec(ns, sz, preset, layout, Path(tmp))
            print(f"[world] {preset} on {layout.name} ({layout.flags() or 'one GPU'}), C{spec['concurrency']}, "
                  f"estimate {estimate_s(ns, layout, preset):.0f} s", flush=True)
            w = run_child(spec, Path(tmp), ns.world_timeout)
            worlds.append(w)
            print_world(preset, layout, w)
            path = write_data(ns.out, serving_result(ns, sz, worlds, time.perf_counter() - t0), allow_nan=False)
    print_comparison(comparison(worlds))
    print(f"[done] {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if all("error" not in w for w in worlds) else 1


def merge_parser(sub) -> None:
    p = sub.add_parser("merge", help="serving result files of one model and workload -> one file, compared again "
                                     "(worlds run side by side on disjoint GPUs, or in several calls)")
    p.add_argument("files", nargs="+"); p.add_argument("--out", required=True)
    p.set_defaults(func=merge)


def merge(ns) -> int:
    """The files merged (dhisparse.bench.multi_report.merge_results); refused when their model or workload differ."""
    datas = [json.loads(Path(f).read_text()) for f in ns.files]
    out = merge_results(ns.files, datas, ns.argv)
    write_data(ns.out, out, allow_nan=False)
    print_comparison(out["comparison"])
    return 0
