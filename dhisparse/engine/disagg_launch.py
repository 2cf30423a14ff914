"""Start a prefill/decode world (engine/disagg.py): rank 0 in this process, this node's other
ranks spawned (multiprocessing "spawn"), as `engine/launch.py` does for data parallelism.

    build_disagg(config)      node 0: spawn ranks 1 .. n-1, build rank 0, join -> DisaggCoordinator
    run_disagg_node(config)   node k > 0 (--node-rank k, its --disaggregation-mode): run its ranks
                              until rank 0 shuts the world down
    each rank                 its engine (`rank_engine`), the gloo world, its role's EP groups
                              (`--ep-size E`), its Wire (an NCCL group of the world on CUDA), then
                              rounds (`disagg_round.follow`)

Under `--ep-size E --enable-dp-attention` (engine/disagg_layout.py) a rank loads only its EP
group's expert block (`ShardSpec("ep", rank mod E, E)`: a checkpoint folder read shard-wise, the
built-in model sharded in memory); after joining, every rank creates every EP group, in order
(`join_ep_groups`: gloo, and NCCL on CUDA), and keeps its own for the MoE exchanges and its
engine's lock-step (`engine.lockstep = any_rank` over the group: a rank of the group with no work
in a step joins its peers' exchanges with an idle pass). The rounds step every rank together, so
an EP group's ranks always meet in the same step.

Every rank builds its engine before it joins, so the rendezvous waits for the slowest model load
within --dist-timeout.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from dhisparse.core.parallel import ControlChannel, any_rank, init_rank, join_ep_groups
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.disagg import DisaggCoordinator
from dhisparse.engine.disagg_layout import DisaggLayout
from dhisparse.engine.disagg_ranks import DecodeRank, PrefillRank
from dhisparse.engine.disagg_round import follow
from dhisparse.engine.disagg_wire import Wire
from dhisparse.engine.engine import Engine
from dhisparse.engine.rank_spawn import (bind_device, free_addr, hook_reference, rank_life, run_hook, shard_engine,
                                         spawn_ranks, wait_ranks)
from dhisparse.models.shard_load import ShardSpec


def rank_engine(config: EngineConfig, layout: DisaggLayout, rank: int, on_engine: str | None = None) -> Engine:
    """One rank's engine: the config on the rank's device as a single engine (the layout's fields
    cleared). A prefill rank reads each whole prompt from its workspace, so it imports prepared
    prefixes onto the device (--admission-placement import); decode ranks keep the setting (auto:
    resident-first while pages are spare, else host-first); a prefill rank's host pool is
    `prefill_host_pool`'s. on_engine: "module:function" called as
    function(engine, rank) (a test or debug hook; its module may give the oracle drafter's reference:
    `rank_spawn.hook_reference`). The rank's CUDA device is made current first (`bind_device`).
    Under EP: the rank's expert block (`ep_engine`)."""
    cfg = dataclasses.replace(config, device=layout.parallel_config().device_of(rank, config.device),
                              disaggregation_mode="null", disaggregation_prefill_size=0, disaggregation_decode_size=0,
                              nnodes=1, node_rank=0, dist_init_addr=None, dp_size=1, tp_size=1, ep_size=1,
                              enable_dp_attention=False)
    bind_device(cfg.device)  # before anything of the engine touches CUDA (rank_spawn.bind_device)
    if layout.role_of(rank) == "prefill":
        cfg = dataclasses.replace(cfg, admission_placement="import", host_pool_bytes=prefill_host_pool(config))
    reference = hook_reference(on_engine, cfg)
    engine = ep_engine(cfg, layout, rank, reference) if layout.expert_parallel else Engine(cfg, oracle_reference=reference)
    run_hook(on_engine, engine, rank)
    return engine


def prefill_host_pool(config: EngineConfig) -> int | None:
    """A prefill rank's host pool: `disaggregation_prefill_host_pool_bytes` when set, else the
    world's `host_pool_bytes` (every rank the same)."""
    return config.disaggregation_prefill_host_pool_bytes or config.host_pool_bytes


def ep_engine(cfg: EngineConfig, layout: DisaggLayout, rank: int, oracle_reference=None) -> Engine:
    """A rank's engine over its EP shard: 1/E of every MoE layer's routed experts (the block of its
    index in its EP group), no CUDA graphs (the exchanges are collectives), lock-step over its EP
    group (`any_rank` there once `join_ep_groups` has run)."""
    cfg = dataclasses.replace(cfg, cuda_graphs="none")
    engine = shard_engine(cfg, ShardSpec("ep", layout.ep_rank(rank), layout.ep_size), layout.ep_size, oracle_reference)
    engine.lockstep = any_rank
    return engine


def join(layout: DisaggLayout, rank: int, addr: str, engine: Engine) -> Wire:
    """Join the world as `rank`, then (EP) every EP group in order; its Wire (KV over the gloo world
    on CPU, over an NCCL group on CUDA)."""
    init_rank(layout.parallel_config(), rank, addr, str(engine.device))
    if layout.expert_parallel:
        join_ep_groups(layout.ep_blocks, rank, str(engine.device), layout.timeout_s)
    if engine.device.type != "cuda":
        return Wire(rank, layout.timeout_s)
    torch.cuda.set_device(engine.device)
    group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=layout.timeout_s))
    return Wire(rank, layout.timeout_s, engine.device, group)


def side_of(layout: DisaggLayout, rank: int, engine: Engine, wire: Wire) -> PrefillRank | DecodeRank:
    role = PrefillRank if layout.role_of(rank) == "prefill" else DecodeRank
    return role(engine, rank, wire)


def _rank_main(config: EngineConfig, rank: int, addr: str, on_engine: str | None) -> None:
    """A spawned rank: build, join, follow; exits 1 when rank 0 is lost (or its engine fails)."""
    layout = config.disagg_layout()
    with rank_life(f"rank {rank} ({layout.role_of(rank)})"):
        engine = rank_engine(config, layout, rank, on_engine)
        wire = join(layout, rank, addr, engine)
        follow(side_of(layout, rank, engine, wire), ControlChannel(rank, layout.world_size), wire)


def _spawn(config: EngineConfig, layout: DisaggLayout, addr: str, on_engine: str | None) -> list:
    return spawn_ranks(_rank_main, config, layout.parallel_config().local_ranks(), addr, on_engine,
                       lambda rank: f"dhisparse-{layout.role_of(rank)}{rank}")


def build_disagg(config: EngineConfig, on_engine: str | None = None) -> DisaggCoordinator:
    """Node 0 of a prefill/decode world: spawn this node's other ranks, build rank 0 (a prefill
    rank), join, and return the Coordinator (the Engine surface)."""
    layout = config.disagg_layout()
    if not layout.enabled or layout.node_rank != 0:
        raise ValueError("build_disagg runs node 0 of a disaggregated world (--disaggregation-prefill-size / "
                         "-decode-size, --node-rank 0); other nodes call run_disagg_node")
    addr = layout.dist_init_addr or free_addr()
    procs = _spawn(config, layout, addr, on_engine)
    try:
        engine = rank_engine(config, layout, 0, on_engine)
        wire = join(layout, 0, addr, engine)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    side = PrefillRank(engine, 0, wire)
    return DisaggCoordinator(side, ControlChannel(0, layout.world_size), wire, layout, procs,
                             beat_s=min(1.0, layout.timeout_s / 4))


def run_disagg_node(config: EngineConfig, on_engine: str | None = None) -> int:
    """A node other than 0: run its ranks until rank 0 shuts the world down; the worst exit code."""
    layout = config.disagg_layout()
    return wait_ranks(_spawn(config, layout, layout.dist_init_addr, on_engine))
