"""What both world starters share (engine/launch.py for DP / TP / EP, engine/disagg_launch.py for
prefill/decode): the default rendezvous, spawning a node's other ranks, a rank's engine over its
shard, and the test / debug hook every rank's engine is handed to.

    free_addr()                           127.0.0.1:<a free port>
    spawn_ranks(target, config, ranks, …)  one "spawn" process a rank but 0: target(config, rank, addr, hook)
    rank_life(label)                      a spawned rank's body: leave the world after; a failure is one line, exit 1
    wait_ranks(procs)                     a node other than 0: wait for its ranks, the worst exit code
    bind_device(device)                   make the rank's CUDA device current before its engine is built
    shard_engine(cfg, shard, ep_size)      the rank's Engine over its ShardSpec (checkpoint read shard-wise)
    run_hook(on_engine, engine, rank)     "module:function" called as function(engine, rank)
    hook_reference(on_engine, cfg)        the oracle drafter's reference from the hook's module, if it has one
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import socket
import sys
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch

from dhisparse.core.parallel import leave
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.memory import resolve_device
from dhisparse.layers.ep_moe import ep_layers
from dhisparse.models.registry import load_for_config
from dhisparse.models.shard_load import ShardSpec


def free_addr() -> str:
    """127.0.0.1 and a port free now (the default rendezvous of a one-node world)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn_ranks(target: Callable, config: EngineConfig, ranks: Iterable[int], addr: str, on_engine: str | None,
                name: Callable[[int], str]) -> list:
    """Start target(config, rank, addr, on_engine) in a "spawn" process for every rank but 0 (rank 0
    runs in the caller); daemon processes named name(rank). Returns them in rank order."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in ranks:
        if rank == 0:
            continue
        p = ctx.Process(target=target, args=(config, rank, addr, on_engine), name=name(rank), daemon=True)
        p.start()
        procs.append(p)
    return procs


@contextmanager
def rank_life(label: str) -> Iterator[None]:
    """A spawned rank's life (build, join, follow) runs inside; then the rank leaves the world. A
    failure is one line on stderr ("dhisparse <label>: <error>"), and the process leaves the world
    and exits 1 (rank 0 sees RankLost)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a rank reports and exits; rank 0 sees RankLost
        print(f"dhisparse {label}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        leave()
        sys.exit(1)
    leave()


def wait_ranks(procs: list) -> int:
    """Wait until every spawned rank of this node has ended (rank 0 shut the world down); the
    worst exit code (0 with none)."""
    for p in procs:
        p.join()
    return max((p.exitcode or 0 for p in procs), default=0)


def bind_device(device: str) -> None:
    """Make a rank's CUDA device (cuda:i) the process's current device, before anything of its
    engine is built. Every process starts on cuda:0, and several things follow the current device
    rather than a tensor's: the engine's side streams and CUDA-graph capture stream
    (models/graphs.py), the fast Triton launcher (kernels/launch.py keys and launches by
    `torch.cuda.current_device()`), zero-copy host views (kernels/uva.py) and NCCL's choice of
    device for a group. Without this a rank on cuda:1 would launch kernels on cuda:0 with cuda:1's
    pointers (and hold a second CUDA context on GPU 0). A no-op off CUDA."""
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def shard_engine(cfg: EngineConfig, shard: ShardSpec, ep_size: int | None = None, oracle_reference=None) -> Engine:
    """The engine of a rank over its shard: the checkpoint read shard-wise onto cfg.device
    (models/shard_load.py), the built-in model sharded in memory. ep_size: expert parallelism, so
    a model with no routed-expert MoE layer is refused naming --ep-size. oracle_reference: the
    oracle drafter's (`hook_reference`)."""
    loaded = load_for_config(cfg, resolve_device(cfg.device), shard=shard)
    if ep_size is not None and ep_layers(loaded.model) == 0:
        raise ValueError(f"--ep-size {ep_size}: {cfg.model} has no routed-expert MoE layers to shard "
                         "(expert parallelism shards GLM-5.x / V3.2 MoE and DeepSeek-V4 MoE layers)")
    return Engine(cfg, loaded=loaded, oracle_reference=oracle_reference)


def hook_reference(on_engine: str | None, cfg: EngineConfig):
    """The oracle drafter's reference (prompt ids -> output ids) a rank's engine is built with: when
    cfg drafts with the oracle (a benchmark measurement tool) and a "module:function" hook is given,
    the hook module's `oracle_reference(cfg)`, which such a module must define (ValueError naming it
    otherwise); else None. The oracle needs its reference when the engine is built, before
    `run_hook`; a benchmark of a parallel world passes it this way (dhisparse/bench/multi.py), since
    the spawned ranks share no objects with rank 0."""
    if not on_engine or cfg.speculative_algorithm != "oracle":
        return None
    name = on_engine.partition(":")[0]
    module = importlib.import_module(name)
    try:
        make = module.oracle_reference
    except AttributeError:
        raise ValueError(f"hook module {name!r} drives an oracle-drafter engine but defines no "
                         "oracle_reference(cfg): the oracle needs its reference when the engine is built") from None
    return make(cfg)


def run_hook(on_engine: str | None, engine: Engine, rank: int) -> None:
    """Call the "module:function" hook (a test or debug hook, e.g. a row checker on every rank)."""
    if on_engine:
        mod, _, fn = on_engine.partition(":")
        getattr(importlib.import_module(mod), fn)(engine, rank)
