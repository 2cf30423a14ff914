"""One rank's pools and one parallel world's memory, clients and time (issue 32; bench/multi_gpu.py).

Every rank of every layout gets the same KV pool and slots, sized as bench/gpu_serving.py sizes one
GPU (`dhisparse.bench.sizing`: --kv-pool-gib, or --resident-fit histories). A disaggregated world's
decode ranks receive whole prompt histories, so their host pool holds those (`host_pool_for`); its
prefill ranks keep the colocated sizing's (`prefill_host_pool_for`). `ns` is bench/multi_gpu.py's
`serving` namespace.

    rank_sizing      one rank's pool, slots and host pool
    clients          a world's clients: --concurrency, or --per-gpu x its decode GPUs
    memory_rows      per layout: weights a GPU holds (routed experts split under EP), pools per rank and world
    estimate_s       a rough guess of one world's wall time (printed before it runs)
    weight_bytes_per_gpu  a built-in model's weight bytes a GPU holds, routed experts split over EP ranks
"""

from __future__ import annotations

import argparse
import functools
import json
import math

from dhisparse.bench.multi import Layout

GIB = float(1 << 30)
# guesses for the printed estimate (s): a world's start (spawn, CUDA context, model build) and prefill rate
BUILD_S = {"glm5-faithful": 40.0}
PREFILL_TOK_S = {"glm5-faithful": 1200.0}


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


def clients(ns, layout: Layout) -> int:
    return ns.concurrency if ns.concurrency is not None else ns.per_gpu * layout.decode_gpus


def host_pool_for(ns, sz: dict, layout: Layout) -> int:
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


def prefill_host_pool_for(ns, sz: dict, layout: Layout) -> int | None:
    """A disaggregated world's prefill ranks' host pool (None elsewhere): the colocated sizing's (the
    shared prefix once + each slot's own pages), since a prefill rank holds only its in-flight
    prompts and sends their KV on (`--disaggregation-prefill-host-pool-bytes`); --host-pool-gib sets
    every rank's."""
    if layout.kind != "pd":
        return None
    return int(ns.host_pool_gib * GIB) if ns.host_pool_gib else sz["host_pool_bytes"]


def world_host_gib(ns, sz: dict, layout: Layout) -> float:
    """Host pool GiB the whole world pins: per rank, and per role in a disaggregated world."""
    pre = prefill_host_pool_for(ns, sz, layout)
    if pre is None:
        return layout.gpus * host_pool_for(ns, sz, layout) / GIB
    return (layout.prefill * pre + layout.decode * host_pool_for(ns, sz, layout)) / GIB


def memory_rows(ns, sz: dict) -> list[dict]:
    """Per layout: weights a GPU holds (routed experts split under EP), the KV pool and host pool a rank holds."""
    rows = []
    for layout in ns.layout_list:
        ep = layout.gpus if layout.kind == "dpep" else layout.ep
        w = weight_bytes_per_gpu(ns.model, ep)
        rows.append({"layout": layout.name, "ep": ep, "weights_per_gpu_gib": w and w["per_gpu"] / GIB,
                     "weights_total_gib": w and w["total"] / GIB, "routed_experts_gib": w and w["routed_experts"] / GIB,
                     "kv_pool_gib": sz["kv_pool_bytes"] / GIB, "host_pool_gib_per_rank": host_pool_for(ns, sz, layout) / GIB,
                     "host_pool_gib_per_prefill_rank": (lambda b: b and b / GIB)(prefill_host_pool_for(ns, sz, layout)),
                     "host_pool_gib_world": world_host_gib(ns, sz, layout),
                     "device_gib_per_gpu_before_activations": w and (w["per_gpu"] + sz["kv_pool_bytes"]) / GIB})
    return rows


def estimate_s(ns, layout: Layout, preset: str) -> float:
    """A rough guess of one world's wall time (printed before it runs; unmeasured rates)."""
    if ns.quick:
        return 10 + ns.duration
    build = BUILD_S.get(ns.model, 20.0)
    prefill = ns.input_len / PREFILL_TOK_S.get(ns.model, 5000.0)
    ref = ns.output_len * 0.15 if preset.endswith("+spec") and not ns.reference_dir else 0.0
    warm = 10 + clients(ns, layout) / layout.decode_gpus * 0.5
    return build + prefill + ref + warm + ns.duration + 10


def weight_bytes_per_gpu(model: str, ep: int = 1) -> dict | None:
    """Weight bytes a GPU holds for a built-in GLM-family model (meta device, nothing allocated):
    {total, routed_experts, per_gpu} with the routed experts split over `ep` ranks; None for others."""
    split = _weight_split(model)
    if split is None:
        return None
    total, experts = split
    return {"total": total, "routed_experts": experts, "per_gpu": total - experts + math.ceil(experts / ep)}


@functools.lru_cache(maxsize=8)
def _weight_split(model: str) -> tuple[int, int] | None:
    """(all weight bytes, routed-expert bytes) of a built-in model, built on the meta device
    (glm5-faithful's layers quantized as its builder quantizes them)."""
    import torch

    from dhisparse.models.dsa import DsaForCausalLM
    from dhisparse.models.faithful import FAITHFUL_CONFIGS, faithful_config, quantize_module
    from dhisparse.models.registry import builtin_config

    try:
        cfg = faithful_config(model) if model in FAITHFUL_CONFIGS else builtin_config(model)
    except KeyError:
        return None
    with torch.device("meta"):
        m = DsaForCausalLM(cfg).to(torch.float32 if model == "tiny" else torch.bfloat16)
        if model in FAITHFUL_CONFIGS:
            for layer in m.model.layers:
                quantize_module(layer)
    total = experts = 0
    for name, t in [*m.named_parameters(), *m.named_buffers()]:
        n = t.numel() * t.element_size()
        total += n
        experts += n if ".mlp.experts." in name else 0
    return total, experts
