"""Selection locality of the scaled and faithful models: hisparse's host-fetched share against the
shared embedding direction (`embed_offset`, dhisparse/models/scaled.py) and the stable index-query
gain (`index_gain`) that calibrate it (`--model glm5-faithful` / `v41-faithful`: models/faithful.py,
models/v4_faithful.py, with `--overrides` for a small geometry on CPU).

    python3 bench/locality.py --out bench/results/locality_cpu.json      # CPU, ~ minutes

Random weights give index scores no query-independent part, so consecutive decode steps select
nearly unrelated rows and a hot cache of B = 2k rows hits only ~B / history of them -- far from
trained models (the paper: 14.2% of selected rows fetched from host at low load with residency off,
B = 2k; 33% at B = k under load). A shared residual direction (every embedding row + offset * u)
adds a stable, key-dependent term to every score. Measured per offset: the host-fetched share of
decode selections after `--warm` steps (hot caches warm), hisparse, one request, a truncated model.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dhisparse.bench import results as R  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="glm52-scaled-k512"); a("--layers", type=int, default=4, help="truncate the layer plan")
    a("--offsets", default="0,1,2,3,4,6"); a("--gains", default="0", help="index_gain values (models/scaled.py)"); a("--hot", default="1,2", help="hot cache sizes B in units of k")
    a("--prompt-len", type=int, default=4096); a("--steps", type=int, default=40); a("--warm", type=int, default=8)
    a("--device", default="cpu"); a("--dtype", default="float32"); a("--threads", type=int, default=2)
    a("--kv-pool-gib", type=float, default=1.0, help="device KV pool (and host pool) of the one-request engine")
    a("--overrides", default=None, help="glm5-faithful / v41-faithful only: config keys as JSON (a small geometry for CPU runs)")
    a("--out", default="bench/results/locality_cpu.json")
    ns = p.parse_args(argv)
    ns.argv = ["bench/locality.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def share(ns, loaded, hot_rows: int) -> dict:
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    eng = Engine(EngineConfig(model=ns.model, preset="hisparse", device=ns.device, cpu_threads=ns.threads,
                              hot_cache_rows=hot_rows, page_size=64, max_running_requests=1,
                              kv_pool_bytes=int(ns.kv_pool_gib * 2**30), host_pool_bytes=int(ns.kv_pool_gib * 2**30),
                              max_num_batched_tokens=4096,
                              max_model_len=ns.prompt_len + ns.steps + ns.warm + 2), loaded=loaded)
    gen = torch.Generator().manual_seed(0)
    eng.add_request(torch.randint(3, 259, (ns.prompt_len,), generator=gen).tolist(),
                    SamplingParams(max_tokens=ns.steps + ns.warm + 1, ignore_eos=True))
    base = None
    while eng.has_unfinished():
        eng.step()
        st = eng.stats()
        if base is None and st.generated_tokens >= ns.warm + 1:
            base = dict(st.counters)
    c = eng.stats().counters
    sel = c["selected_rows"] - base["selected_rows"]
    host = c["host_selected_rows"] - base["host_selected_rows"]
    return {"hot_cache_rows": hot_rows, "selected_rows": sel, "host_selected_rows": host, "host_fetched_share": host / sel}


def build(ns, **locality):
    """ns.model (glm5-faithful, v41-faithful or a scaled GLM) at ns.dtype on ns.device, truncated to
    ns.layers, with ns.overrides (faithful models), the byte tokenizer, and `locality` (embed_offset,
    index_gain) given to the builder (its own constants where left out)."""
    from dhisparse.engine.memory import DTYPES
    from dhisparse.models.faithful import build_faithful
    from dhisparse.models.scaled import build_scaled
    from dhisparse.models.tokenizer import ByteTokenizer
    from dhisparse.models.v4_faithful import build_v41_faithful

    dtype, overrides = DTYPES[ns.dtype], json.loads(ns.overrides or "{}")
    if ns.model == "glm5-faithful":
        loaded = build_faithful(ns.model, 0, dtype, ns.device, ns.layers, overrides, **locality)
    elif ns.model == "v41-faithful":
        loaded = build_v41_faithful(0, dtype, ns.device, ns.layers, overrides, **locality)
    else:
        loaded = build_scaled(ns.model, 0, dtype, ns.device, ns.layers, **locality)
    return dataclasses.replace(loaded, tokenizer=ByteTokenizer())


def main(argv=None) -> int:
    ns = parse(argv)
    torch.set_num_threads(ns.threads)
    rows, t0 = [], time.perf_counter()
    for off in [float(x) for x in ns.offsets.split(",")]:
        for gain in [float(x) for x in ns.gains.split(",")]:
            loaded = build(ns, embed_offset=off, index_gain=gain)
            k = loaded.config.index_topk
            for m in [float(x) for x in ns.hot.split(",")]:
                r = {"embed_offset": off, "index_gain": gain, "B_over_k": m, **share(ns, loaded, int(m * k))}
                rows.append(r)
                print(f"offset {off:4.1f}  gain {gain:4.1f}  B = {m:g}k: host-fetched share "
                      f"{100 * r['host_fetched_share']:5.1f}% ({time.perf_counter() - t0:.0f} s)", flush=True)
            del loaded  # a full-size build is most of a GPU: free it (and the engines' cycles) before the next
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            R.write_doc("locality", ns, ns.out, rows=rows)  # after every build: a call cut short keeps what ran
    return 0


if __name__ == "__main__":
    sys.exit(main())
