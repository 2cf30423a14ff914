"""Decode-step profile (Fig. 10): where one engine step's time goes, per preset, at a fixed load.

    python3 bench/step_profile.py --out $OUT/step_profile.json                    # H200
    python3 bench/step_profile.py --quick --out /tmp/step_profile.json            # CPU smoke

For each preset: a fresh engine over the shared model, C requests importing the prepared prefix
(+ a short suffix) are driven until every one is decoding; after `--warmup` steps, `--steps` steps
are timed (wall, synchronised), the same number under a per-phase host clock (bench/host_phases.py),
then the same number under cProfile (host functions, top by
own time) and under torch.profiler (CUDA kernels). From the kernel trace:
  busy_ms   union of kernel intervals in the step window (the GPU doing anything),
  idle      1 - busy / wall: time with no kernel running -- the host-bound share of the step,
  family    kernel time by family (resolver, copy, attention, indexer, gemm, moe, norm/rope/elementwise,
            other), each counted as its summed durations, and `alone` where no other family runs.
The host-side time per step is reported as `host_ms` = wall - busy (time the GPU waits for Python).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import attention_replay  # noqa: E402
from bench.host_phases import phase_steps  # noqa: E402
from bench.gpu_serving import check_geometry, geometry_args, load_model  # noqa: E402
from bench.kernel_families import family, family_times  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402
from dhisparse.bench.workload import prefix_ids, suffix_text  # noqa: E402
from dhisparse.core.kvformat import KV_CACHE_DTYPES  # noqa: E402
from dhisparse.engine.config import RESOLVER_LOOKUPS, EngineConfig  # noqa: E402
from dhisparse.engine.memory import release_memory  # noqa: E402
from dhisparse.core.params import SamplingParams  # noqa: E402

QUICK = dict(model="tiny", device="cpu", dtype="float32", input_len=160, concurrency=4, steps=4, warmup=2,
             kv_pool_gib=0.05, host_pool_gib=0.05, page_size=16, hot_cache_rows=None, max_batched_tokens=1024)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="glm52-scaled-k512"); a("--device", default="cuda"); a("--dtype", default="bfloat16")
    geometry_args(a)
    a("--presets", default="resident,hisparse,adaptive,adaptive+spec")
    a("--input-len", type=int, default=8192); a("--concurrency", type=int, default=32)
    a("--steps", type=int, default=10); a("--warmup", type=int, default=4)
    a("--kv-pool-gib", type=float, default=40.0); a("--host-pool-gib", type=float, default=40.0)
    a("--page-size", type=int, default=64); a("--hot-cache-rows", type=int, default=None)
    a("--prefetch-stream", default="compute", choices=("compute", "side"),
      help="follower layers' copies: with the producer's (compute) or layer-wise on a side stream (side)")
    a("--resolver-copy", default="separate", choices=("separate", "fused"),
      help="the Triton resolver's producer copies: a gather launch of their own, or made by the plan kernel")
    a("--resolver-lookup", default="scan", choices=RESOLVER_LOOKUPS,
      help="hot-cache hits: scanned for, or looked up in the store's position -> hot entry index")
    a("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="stored row format (auto, bfloat16, fp8_e4m3: 656-B rows)")
    a("--max-batched-tokens", type=int, default=16384)
    a("--top", type=int, default=25, help="host functions (and CUDA kernels) listed per preset")
    a("--drafter", default="ngram", choices=("ngram", "oracle"),
      help="+spec presets: the n-gram drafter (its acceptance is whatever the prompts give) or 'oracle': a "
           "placeholder reference, so every round verifies the full width and rejects its drafts (the cost "
           "of a full-width round; acceptance is not measured)")
    a("--spec-width", type=int, default=4, help="verification width (queries per request and round)")
    a("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
      help="any EngineConfig field (repeatable; typed as bench/gpu_serving.py types them), e.g. "
           "speculative_oracle_drafter=dflash2 and speculative_draft_model_path=DIR: the costed oracle, whose "
           "drafter network runs every round, so the profile prices the drafter's kernels with the round's")
    a("--cuda-graphs", default="auto", help="auto, none, ffn, layer (piecewise CUDA graphs, see dhisparse/models/graphs.py) or step (+ whole-step graphs, dhisparse/engine/step_graphs.py); "
      "a comma list profiles every preset under each mode, side by side")
    a("--out", default="bench/results/step_profile.json")
    a("--quick", action="store_true")
    a("--verbose", action="store_true", help="time every step on the way to decode; cProfile that phase")
    a("--attention-replay", type=int, default=0, metavar="N",
      help="time the sparse-MLA kernel on N recorded attention calls of one eager step (bench/attention_replay.py; "
           "needs --cuda-graphs none)")
    a("--sync-report", action="store_true", help="CUDA: list the call sites that synchronise during two steps")
    a("--isolate", action=argparse.BooleanOptionalAction, default=None,
      help="each preset / graph mode in its own process (default on CUDA: a finished torch.profiler session "
           "leaves CUPTI hooks that slow every later launch in the process, so later presets time slower)")
    ns = p.parse_args(argv)
    if ns.quick:
        for k, v in QUICK.items():
            setattr(ns, k, v)
    check_geometry(p, ns)
    ns.argv = ["bench/step_profile.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def engine_config(ns, preset: str, graphs: str = "none") -> EngineConfig:
    """The preset's engine at the profile's shape, with --engine-arg overrides applied last."""
    from bench.gpu_serving import engine_overrides

    spec = preset.endswith("+spec")
    cfg = EngineConfig(model=ns.model, preset=preset, device=ns.device, dtype=ns.dtype, page_size=ns.page_size,
                        kv_pool_bytes=int(ns.kv_pool_gib * 2**30), host_pool_bytes=int(ns.host_pool_gib * 2**30),
                        max_running_requests=ns.concurrency, max_num_batched_tokens=ns.max_batched_tokens,
                        hot_cache_rows=ns.hot_cache_rows, max_model_len=ns.input_len + 4096,
                        speculative_algorithm=ns.drafter if spec else None, speculative_num_draft_tokens=ns.spec_width,
                        cuda_graphs=graphs, kv_cache_dtype=ns.kv_cache_dtype, prefetch_stream=ns.prefetch_stream,
                        resolver_copy=ns.resolver_copy, resolver_lookup=ns.resolver_lookup)
    return dataclasses.replace(cfg, **engine_overrides(ns.engine_arg)) if ns.engine_arg else cfg


def placeholder_reference(prompt: list[int]) -> list[int]:
    """The `--drafter oracle` reference: a fixed continuation the target does not produce, so each
    round proposes width - 1 drafts and the verifier rejects them."""
    return [7] * 8192


def sync(device: str) -> None:
    """Wait for the compute stream only, as the engine's own token read does: residency copies on
    the side stream overlap later steps and are not charged to this one."""
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()


def drive_to_decode(engine, ns) -> None:
    """C requests admitted and past prefill (every running request is decoding)."""
    t0 = time.perf_counter()
    prefix = prefix_ids(engine.tokenizer, ns.input_len, engine.model_config.vocab_size)
    if engine.prefixes.match(prefix)[0] is None:
        engine.prepare_prefix(prefix)
    print(f"  prefix ready {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(max_tokens=4000, ignore_eos=True)
    for i in range(ns.concurrency):
        engine.add_request(prefix + engine.tokenizer.encode(suffix_text(i)), params)
    stable = 0
    for step in range(10_000):
        run = engine.scheduler.running
        decoding = bool(run) and not any(r.in_prefill for r in run)
        stable = stable + 1 if decoding else 0
        # every request decoding, or admissions stopped for good (memory-bound): an admission can
        # wait a few steps for host copies to free pages, so a short pause is not the end of them
        if decoding and (len(run) == ns.concurrency or stable >= 30):
            print(f"  {len(run)} of {ns.concurrency} decoding after {step} steps, {time.perf_counter() - t0:.1f} s", flush=True)
            return
        t = time.perf_counter()
        engine.step()
        sync(ns.device)
        if ns.verbose:
            print(f"  step {step}: {1e3 * (time.perf_counter() - t):.0f} ms, running {len(run)}, "
                  f"prefilling {sum(r.in_prefill for r in run)}", flush=True)
    raise RuntimeError("requests never reached decode")


class BlockedClock:
    """Time the host spends blocked reading device values (`tolist` / `item`: the step's syncs)
    while installed; everything else in `engine.step()` is host work."""

    def __init__(self) -> None:
        self.blocked = 0.0

    def __enter__(self) -> "BlockedClock":
        self.saved = torch.Tensor.tolist, torch.Tensor.item
        for name, fn in zip(("tolist", "item"), self.saved):
            setattr(torch.Tensor, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def wrapper(t, *a, **k):
            t0 = time.perf_counter()
            try:
                return fn(t, *a, **k)
            finally:
                self.blocked += time.perf_counter() - t0

        return wrapper

    def __exit__(self, *exc) -> None:
        torch.Tensor.tolist, torch.Tensor.item = self.saved


def timed_steps(engine, ns) -> tuple[list[float], list[float]]:
    """Unprofiled steps: (wall ms, host ms) per step. Host = the time `engine.step()` runs on
    the CPU minus the time it waits for the device (see `BlockedClock`)."""
    walls, hosts = [], []
    for _ in range(ns.steps):
        sync(ns.device)
        with BlockedClock() as clock:
            t = time.perf_counter()
            engine.step()
            t_host = time.perf_counter() - t - clock.blocked
            sync(ns.device)
            walls.append((time.perf_counter() - t) * 1e3)
        hosts.append(t_host * 1e3)
    return walls, hosts


def host_profile(engine, ns) -> tuple[list[dict], list[dict]]:
    """cProfile over `steps` steps: (top functions by own time, top dhisparse functions by
    cumulative time), per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(ns.steps):
        engine.step()
    sync(ns.device)
    prof.disable()
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"fn": f"{os.path.relpath(file) if file.startswith('/') else file}:{line}:{fn}",
                     "calls_per_step": nc / ns.steps, "own_ms_per_step": tt * 1e3 / ns.steps,
                     "cum_ms_per_step": ct * 1e3 / ns.steps})
    cum = sorted((r for r in rows if "dhisparse/" in r["fn"]), key=lambda r: -r["cum_ms_per_step"])
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[: ns.top], cum[: ns.top]


def dhisparse_site() -> str:
    """The innermost frame of the current stack inside the dhisparse package (not its bench
    harness), as 'path:line function'; '?' if none."""
    import traceback

    for f in reversed(traceback.extract_stack()):
        if "/dhisparse/" in f.filename and "/bench/" not in f.filename:
            return f"{f.filename.split('/dhisparse/')[-1]}:{f.lineno} {f.name}"
    return "?"


def sync_report(engine, ns) -> dict:
    """Call sites (innermost dhisparse frame) of operations that synchronise host and device during
    two steps, from torch's sync debug mode; {site: count per step}."""
    if not ns.device.startswith("cuda"):
        return {}
    import collections
    import warnings

    sites: collections.Counter = collections.Counter()
    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = lambda *a, **k: sites.update([dhisparse_site()])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {k: v / 2 for k, v in sites.most_common()}


def kernel_profile(engine, ns) -> dict:
    if not ns.device.startswith("cuda"):
        return {}
    from torch.profiler import ProfilerActivity, profile

    sync(ns.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(ns.steps):
            engine.step()
        sync(ns.device)
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    fam = family_times(kernels)
    per = lambda v: {k: x / ns.steps for k, x in v.items()} if isinstance(v, dict) else v / ns.steps  # noqa: E731
    return {"profiled_wall_ms_per_step": wall / ns.steps, **{k: per(v) for k, v in fam.items()},
            "top_kernels": top_kernels(kernels, ns.steps, ns.top)}


def top_kernels(kernels: list[tuple[str, float, float]], steps: int, top: int) -> list[dict]:
    """The `top` kernel names by summed duration: ms and launches per step, and their family."""
    ms: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, a, b in kernels:
        ms[name] = ms.get(name, 0.0) + (b - a) / 1e3
        calls[name] = calls.get(name, 0) + 1
    rows = sorted(ms, key=lambda n: -ms[n])[:top]
    return [{"name": n[:120], "family": family(n), "ms_per_step": ms[n] / steps, "calls_per_step": calls[n] / steps}
            for n in rows]


def one_preset(ns, loaded, prefixes, preset: str, graphs: str) -> dict:
    from dhisparse.engine.engine import Engine

    t0 = time.perf_counter()
    reference = placeholder_reference if ns.drafter == "oracle" and preset.endswith("+spec") else None
    engine = Engine(engine_config(ns, preset, graphs), loaded=loaded, oracle_reference=reference)
    engine.prefixes = prefixes
    print(f"  engine built {time.perf_counter() - t0:.1f} s", flush=True)
    if ns.verbose:
        prof = cProfile.Profile()
        prof.runcall(drive_to_decode, engine, ns)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    else:
        drive_to_decode(engine, ns)
    admitted = len(engine.scheduler.running)
    for _ in range(ns.warmup):
        engine.step()
    walls, hosts = timed_steps(engine, ns)
    phases = phase_steps(engine, ns.steps, lambda: sync(ns.device))
    host, host_cum = host_profile(engine, ns)
    kern = kernel_profile(engine, ns)
    syncs = sync_report(engine, ns) if ns.sync_report else {}
    replayed = attention_replay.replay(engine.step, preset, ns.spec_width, ns.attention_replay) if ns.attention_replay else []
    st = engine.stats().as_dict()
    fp8_activations = engine.fp8_activations  # what --engine-arg fp8_activations (default auto) resolved to
    del engine
    release_memory()
    walls.sort()
    hosts.sort()
    res = {"preset": preset, "cuda_graphs": graphs, "fp8_activations": fp8_activations, "C": ns.concurrency, "admitted": admitted, "wall_ms_median": walls[len(walls) // 2], "wall_ms": walls,
           "host_unprofiled_ms_median": hosts[len(hosts) // 2], "host_unprofiled_share": hosts[len(hosts) // 2] / walls[len(walls) // 2],
           "host_phases_ms": phases, "kernels": kern, "host_top": host, "host_cum_top": host_cum, "sync_sites": syncs, "attention_replay": replayed, "counters": {k: v for k, v in st.items() if isinstance(v, (int, float))}}
    if kern:
        res["host_ms"] = max(0.0, kern["profiled_wall_ms_per_step"] - kern["busy_ms"])
        res["host_share"] = res["host_ms"] / kern["profiled_wall_ms_per_step"]
    return res


def isolated(ns, preset: str, graphs: str) -> dict:
    """`one_preset` in a fresh process (see --isolate); its run record comes back through a file."""
    import json
    import subprocess
    import tempfile

    skip = {"--presets", "--cuda-graphs", "--out"}
    args, it = [], iter(ns.argv[1:])
    for a in it:
        if a.split("=")[0] in skip:
            if "=" not in a:
                next(it, None)
            continue
        if a not in ("--isolate", "--no-isolate"):
            args.append(a)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--presets", preset, "--cuda-graphs", graphs,
                        "--no-isolate", "--out", out], check=True)
        with open(out) as f:
            return json.load(f)["runs"][0]


def main(argv=None) -> int:
    ns = parse(argv)
    import faulthandler

    faulthandler.enable()  # (no periodic dump_traceback_later: dumping a running thread crashed once)
    from dhisparse.kv.memory.prefix_store import PrefixStore

    t0 = time.perf_counter()
    modes = [m.strip() for m in ns.cuda_graphs.split(",") if m.strip()]
    combos = [(p.strip(), m) for p in ns.presets.split(",") if p.strip() for m in modes]
    isolate = ns.device.startswith("cuda") if ns.isolate is None else ns.isolate
    if isolate and len(combos) > 1:
        loaded = prefixes = None
    else:
        isolate = False
        loaded = load_model(ns)  # a built-in by name, or a faithful model at --layers / --overrides
        prefixes = PrefixStore(pin=ns.device.startswith("cuda"))
    runs = []
    for preset, graphs in combos:
        t = time.perf_counter()
        runs.append(isolated(ns, preset, graphs) if isolate else one_preset(ns, loaded, prefixes, preset, graphs))
        # rewritten after each preset (complete: False until the last): a call cut short keeps the presets it finished
        R.write_doc("step_profile", ns, ns.out, json_default=str, runs=runs, complete=len(runs) == len(combos),
                    gpu=torch.cuda.get_device_name() if ns.device.startswith("cuda") else "cpu",
                    wall_s=time.perf_counter() - t0)
        r = runs[-1]
        print(f"[profile] {preset:14} graphs={graphs:5} C{ns.concurrency} step {r['wall_ms_median']:.2f} ms; host (unprofiled) "
              f"{r['host_unprofiled_ms_median']:.2f} ms ({100 * r['host_unprofiled_share']:.1f}%); GPU idle (profiled) "
              f"{r.get('host_ms', float('nan')):.2f} ms ({100 * r.get('host_share', float('nan')):.1f}%) "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        ph = r.get("host_phases_ms", {})
        print("    host phases (ms/step): " + " ".join(f"{k} {v:.2f}" for k, v in ph.items()))
        for h in r["host_top"][:8]:
            print(f"    {h['own_ms_per_step']:7.3f} ms own {h['cum_ms_per_step']:8.3f} cum {h['calls_per_step']:7.1f}x  {h['fn']}")
        for k, v in list(r["sync_sites"].items())[:10]:
            print(f"    sync {v:5.1f}/step  {k}")
        for k, v in sorted(r["kernels"].get("family_ms", {}).items(), key=lambda kv: -kv[1]):
            print(f"    {k:22} {v:8.3f} ms  alone {r['kernels']['alone_ms'].get(k, 0.0):8.3f} ms")
        for t in r["kernels"].get("top_kernels", [])[:12]:
            print(f"    {t['ms_per_step']:7.3f} ms {t['calls_per_step']:6.1f}x  [{t['family']}] {t['name'][:90]}")
    print(f"[done] {ns.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
