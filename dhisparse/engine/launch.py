"""Start a data-parallel world: rank 0 in this process, ranks 1..n-1 spawned (`start_ranks`).

    config.parallel_config() -> world size n, nodes, rendezvous address, deadline
    this node's other ranks: multiprocessing "spawn" -> _rank_main(config, rank, addr) -> follow()
    rank 0 (node 0): joins, builds its Engine, returns a Coordinator with the Engine surface

Every rank builds its own engine (model, pools, host store) before it joins, so the rendezvous
waits for the slowest model load within `--dist-timeout`. A node other than 0 (`--node-rank`)
runs only followers: `run_node` blocks until rank 0 shuts the world down.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing as mp
import socket
import sys

from dhisparse.core.parallel import ControlChannel, ParallelConfig, any_rank, init_rank, leave
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.distributed import Coordinator, follow
from dhisparse.engine.engine import Engine
from dhisparse.layers.ep_moe import shard_experts


def free_addr() -> str:
    """127.0.0.1 and a port free now (the default rendezvous of a one-node world)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def rank_engine(config: EngineConfig, pc: ParallelConfig, rank: int, on_engine: str | None = None) -> Engine:
    """The engine of one rank: the same config on that rank's device (cuda:local index on CUDA).
    on_engine: "module:function" called as function(engine, rank) (a test or debug hook, e.g. a row
    checker on every rank)."""
    rank_cfg = dataclasses.replace(config, device=pc.device_of(rank, config.device))
    if pc.expert_parallel:  # the MoE exchanges are collectives: no CUDA graphs, one pass a step
        rank_cfg = dataclasses.replace(rank_cfg, cuda_graphs="none")
    engine = Engine(rank_cfg)
    if pc.expert_parallel:
        if shard_experts(engine.model, rank, pc.world_size) == 0:
            raise ValueError(f"--ep-size {pc.ep_size}: {config.model} has no MoE layers of the DSA target to shard "
                             "(DeepSeek-V4 expert parallelism is not built yet)")
        engine.lockstep = any_rank
    if on_engine:
        mod, _, fn = on_engine.partition(":")
        getattr(importlib.import_module(mod), fn)(engine, rank)
    return engine


def _rank_main(config: EngineConfig, rank: int, addr: str, on_engine: str | None) -> None:
    """A follower process: build, join, follow; exits 1 when rank 0 is lost."""
    pc = config.parallel_config()
    try:
        engine = rank_engine(config, pc, rank, on_engine)
        init_rank(pc, rank, addr, str(engine.device))
        follow(engine, ControlChannel(rank, pc.world_size))
    except Exception as e:  # noqa: BLE001 - a follower reports and exits; rank 0 sees RankLost
        print(f"dhisparse rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        leave()
        sys.exit(1)
    leave()


def spawn_followers(config: EngineConfig, pc: ParallelConfig, addr: str, on_engine: str | None) -> list:
    ctx = mp.get_context("spawn")
    procs = []
    for rank in pc.local_ranks():
        if rank == 0:
            continue
        p = ctx.Process(target=_rank_main, args=(config, rank, addr, on_engine), name=f"dhisparse-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    return procs


def start_ranks(config: EngineConfig, on_engine: str | None = None) -> Coordinator:
    """Rank 0 of a data-parallel world (this process must run node 0): spawns this node's other
    ranks, builds rank 0's engine, joins, and returns the Coordinator."""
    pc = config.parallel_config()
    if pc.node_rank != 0:
        raise ValueError("start_ranks runs node 0 (--node-rank 0); other nodes call run_node")
    addr = pc.dist_init_addr or free_addr()
    procs = spawn_followers(config, pc, addr, on_engine)
    try:
        engine = rank_engine(config, pc, 0, on_engine)
        init_rank(pc, 0, addr, str(engine.device))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return Coordinator(engine, ControlChannel(0, pc.world_size), procs, beat_s=min(1.0, pc.timeout_s / 4))


def build(config: EngineConfig, on_engine: str | None = None) -> "Engine | Coordinator":
    """The engine a config asks for: a plain Engine in this process at world size 1 (nothing of
    torch.distributed is touched), else rank 0's Coordinator of a data-parallel world."""
    if not config.parallel_config().distributed:
        return rank_engine(config, config.parallel_config(), 0, on_engine) if on_engine else Engine(config)
    return start_ranks(config, on_engine)


def run_node(config: EngineConfig, on_engine: str | None = None) -> int:
    """A node other than 0: run its ranks until rank 0 shuts the world down; the worst exit code."""
    pc = config.parallel_config()
    procs = spawn_followers(config, pc, pc.dist_init_addr, on_engine)
    for p in procs:
        p.join()
    return max((p.exitcode or 0 for p in procs), default=0)
