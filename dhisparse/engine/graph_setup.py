"""The engine's CUDA graphs at build (step 0 of docs/structure.md): the graph mode (`auto`
resolved for the device and model) and the per-layer graph pieces of `models/graphs.py`, captured
for every decode / verification bucket before serving and kept on the model for later engines.
Whole-step graphs (mode `step`) are `engine/step_graphs.py`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dhisparse.engine.config import EngineConfig
from dhisparse.models.graphs import CudaGraphRunner, auto_graph_mode, graphs_for

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine

log = logging.getLogger("dhisparse.engine")


def set_graphs(eng: Engine, mode: str) -> None:
    """`eng.graph_mode` from `--cuda-graphs` (`auto` resolved) and the model's graph set for it;
    a mode other than "none" for a model without graph support is a ValueError."""
    experts = eng.model_config.n_routed_experts
    if mode == "auto":
        mode = auto_graph_mode(eng.device, eng.model.supports_cuda_graphs, experts)
    eng.graph_mode = mode
    if not eng.model.supports_cuda_graphs:
        if mode != "none":
            raise ValueError(f"cuda_graphs {mode!r} is available for DSA models (GLM-5.x, DeepSeek-V3.2) only")
        return
    eng.model.graphs = graphs_for(eng.device, mode, experts, eng.model.graphs)


def drafter_graphs(eng: Engine, config: EngineConfig) -> bool:
    """The drafter's network replays from its own CUDA graphs (spec/dflash_graphs.py for the DFlash
    family) on CUDA unless `--cuda-graphs none`; independent of the target's graph mode (a
    DeepSeek-V4 target has none, its DFlash / DSpark drafter does). Every bucket up to
    `--cuda-graph-max-bs` (default: the request slots) is captured here, before the KV pool is
    sized from what is free."""
    if eng.spec is None or eng.device.type != "cuda" or config.cuda_graphs == "none":
        return False
    t = time.perf_counter()
    on = eng.spec.drafter.use_graphs(CudaGraphRunner(), config.graph_max_reqs)
    if on:
        log.info("drafter: block pass from CUDA graphs, rounds of up to %d requests (captured in %.1f s)",
                 config.graph_max_reqs, time.perf_counter() - t)
    return on


def capture_graphs(eng: Engine, config: EngineConfig) -> None:
    """Graph pieces for every decode / verification batch size, captured before serving."""
    if eng.model.graphs is None:
        return
    t0 = time.perf_counter()
    per_request = config.speculative_num_draft_tokens if config.speculative else 1
    n = eng.model.capture_graphs(config.graph_max_reqs * per_request, eng._row_spaces,
                                 eng.arena.formats.latent)
    if n:
        log.info("captured %d CUDA graphs (pieces x layers x buckets <= %d tokens) in %.1f s", n,
                 eng.model.graphs.limit, time.perf_counter() - t0)
