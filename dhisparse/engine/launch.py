"""Start a parallel world: rank 0 in this process, ranks 1..n-1 spawned (`start_ranks`).

    config.parallel_config() -> world size n, nodes, rendezvous address, deadline
    this node's other ranks: multiprocessing "spawn" -> _rank_main(config, rank, addr) -> follow()
    rank 0 (node 0): joins, builds its Engine, returns a Coordinator with the Engine surface

Every rank builds its own engine (model, pools, host store) before it joins, so the rendezvous
waits for the slowest model load within `--dist-timeout`. A node other than 0 (`--node-rank`)
runs only followers: `run_node` blocks until rank 0 shuts the world down.

Tensor parallelism (`--tp-size N` alone) and expert parallelism (`--ep-size N` with DP attention):
each rank loads only its shard (`ShardSpec`) and builds its engine over it (the pool is sized with
the shard's weights on the device). A checkpoint folder is read shard-wise straight onto the rank's
device (models/shard_load.py: TP heads / intermediate blocks of layers/tp.py, EP expert blocks of
layers/ep_moe.py; the full weights never exist in one process; the load's host / device peak is
logged); a built-in random model is built whole on the CPU and sharded in memory. Under TP the
ranks run the same requests (the Coordinator's replicate mode), so their schedulers must stay
identical: the inputs that read a clock are fixed (strict first-come admission, loads on the
compute stream; DSpark and the online width policy refused), the pools are checked equal at start,
and every step's batch is checked equal on every rank before its pass (`guard_batches`).
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.core.parallel import ControlChannel, ParallelConfig, ParallelConfigError, agree, any_rank, init_rank, leave
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.disagg import DisaggCoordinator
from dhisparse.engine.disagg_launch import build_disagg, run_disagg_node
from dhisparse.engine.distributed import Coordinator, follow
from dhisparse.engine.engine import Engine
from dhisparse.engine.rank_spawn import (bind_device, free_addr, hook_reference, rank_life, run_hook, shard_engine,
                                         spawn_ranks, wait_ranks)
from dhisparse.models.shard_load import ShardSpec

BATCH_CHECK = "the tensor-parallel batch check (every rank must run the same requests and rows)"
POOL_CHECK = "the tensor-parallel pool check (every rank must size the same KV pools: set --kv-pool-bytes)"


def rank_engine(config: EngineConfig, pc: ParallelConfig, rank: int, on_engine: str | None = None) -> Engine:
    """The engine of one rank: the same config on that rank's device (cuda:local index on CUDA, made
    the process's current device first: `rank_spawn.bind_device`). on_engine: "module:function"
    called as function(engine, rank) (a test or debug hook, e.g. a row checker on every rank); its
    module may also give the oracle drafter's reference (`rank_spawn.hook_reference`)."""
    rank_cfg = dataclasses.replace(config, device=pc.device_of(rank, config.device))
    bind_device(rank_cfg.device)  # before anything of the engine touches CUDA (rank_spawn.bind_device)
    if pc.expert_parallel or pc.tensor_parallel:  # the exchanges / sums are collectives: no CUDA graphs, one pass a step
        rank_cfg = dataclasses.replace(rank_cfg, cuda_graphs="none")
    if pc.tensor_parallel:
        rank_cfg = tp_engine_config(rank_cfg)
    reference = hook_reference(on_engine, rank_cfg)
    if pc.tensor_parallel or pc.expert_parallel:
        shard = ShardSpec("tp" if pc.tensor_parallel else "ep", rank, pc.world_size)
        engine = shard_engine(rank_cfg, shard, pc.ep_size if pc.expert_parallel else None, reference)
    else:
        engine = Engine(rank_cfg, oracle_reference=reference)
    if pc.tensor_parallel:
        guard_batches(engine)
    if pc.expert_parallel:
        engine.lockstep = any_rank
    run_hook(on_engine, engine, rank)
    return engine


def tp_engine_config(config: EngineConfig) -> EngineConfig:
    """A TP rank's config: no input of the scheduler may read a clock. Admission is strict
    first-come-first-served (admission_lookahead 0: the age bound compares each rank's own
    arrival times), loads run on the compute stream (a side stream's completion is polled); DSpark
    and the online width policy, which time each rank's steps, are refused naming --tp-size."""
    spec = config.spec_config()
    if spec is not None and (spec.policy == "online" or "dspark" in (spec.algorithm, spec.oracle_drafter)):
        raise ParallelConfigError(f"--tp-size {config.tp_size}: DSpark widths and the online width policy are chosen "
                                  "from each rank's own step timings, so the ranks would disagree; use a fixed or "
                                  "static policy with dflash / dflash2 / mtp / ngram")
    return dataclasses.replace(config, admission_lookahead=0, load_stream="compute")


def fingerprint(request_ids: list[str], batch: ForwardBatch) -> list[int]:
    """[requests, rows, 63-bit digest of (request ids, row offsets, lengths), a position-weighted
    sum of the token ids] of one pass. The token sum (one small device read a pass) catches ranks
    that sampled different tokens for the same rows."""
    digest = hashlib.blake2b(repr((list(request_ids), batch.query_start, batch.lens)).encode(), digest_size=8)
    ids = batch.input_ids
    tokens = int((ids * torch.arange(1, ids.shape[0] + 1, device=ids.device)).sum()) if ids.numel() else 0
    return [len(request_ids), batch.num_tokens, int.from_bytes(digest.digest(), "little", signed=True), tokens]


def guard_batches(engine: Engine) -> None:
    """Under TP every rank checks, once a pass and before it, that every rank runs the same
    requests with the same rows (`agree` on `fingerprint`, at the store's context); a rank with
    no work checks the empty fingerprint in the engine's lockstep call, so a rank with a pass
    always meets its peers at the same collective. A mismatch is RankLost on every rank (rank 0
    reports it), never a pass whose sums pair unrelated rows."""
    inner = engine.store.context

    def context(batch: ForwardBatch, reqs: list[str]):
        agree(fingerprint(reqs, batch), BATCH_CHECK)
        return inner(batch, reqs)

    def lockstep(has_work: bool) -> bool:
        if not has_work:
            agree([0, 0, 0, 0], BATCH_CHECK)
        return has_work

    engine.store.context, engine.lockstep = context, lockstep


def check_pools(engine: Engine) -> None:
    """Under TP, at start (after joining): every rank's device and host pools hold the same pages,
    or admission could differ between ranks (RankLost naming --kv-pool-bytes)."""
    st = engine.stats()
    agree([st.kv_pages_total, int(st.counters.get("host_pages_total", 0))], POOL_CHECK)


def _rank_main(config: EngineConfig, rank: int, addr: str, on_engine: str | None) -> None:
    """A follower process: build, join, follow; exits 1 when rank 0 is lost."""
    pc = config.parallel_config()
    with rank_life(f"rank {rank}"):
        engine = rank_engine(config, pc, rank, on_engine)
        init_rank(pc, rank, addr, str(engine.device))
        if pc.tensor_parallel:
            check_pools(engine)
        follow(engine, ControlChannel(rank, pc.world_size), outputs=not pc.tensor_parallel)


def spawn_followers(config: EngineConfig, pc: ParallelConfig, addr: str, on_engine: str | None) -> list:
    return spawn_ranks(_rank_main, config, pc.local_ranks(), addr, on_engine, lambda rank: f"dhisparse-rank{rank}")


def start_ranks(config: EngineConfig, on_engine: str | None = None) -> Coordinator:
    """Rank 0 of a parallel world (this process must run node 0): spawns this node's other ranks,
    builds rank 0's engine, joins, and returns the Coordinator (replicating every request to
    every rank under tensor parallelism)."""
    pc = config.parallel_config()
    if pc.node_rank != 0:
        raise ValueError("start_ranks runs node 0 (--node-rank 0); other nodes call run_node")
    addr = pc.dist_init_addr or free_addr()
    procs = spawn_followers(config, pc, addr, on_engine)
    try:
        engine = rank_engine(config, pc, 0, on_engine)
        init_rank(pc, 0, addr, str(engine.device))
        if pc.tensor_parallel:
            check_pools(engine)
    except BaseException:
        for p in procs:
            p.kill()
        leave()
        raise
    return Coordinator(engine, ControlChannel(0, pc.world_size), procs, beat_s=min(1.0, pc.timeout_s / 4),
                       replicate=pc.tensor_parallel)


def build(config: EngineConfig, on_engine: str | None = None) -> "Engine | Coordinator | DisaggCoordinator":
    """The engine a config asks for: a plain Engine in this process at world size 1 (nothing of
    torch.distributed is touched), rank 0's Coordinator of a parallel world, or node 0's
    DisaggCoordinator of a prefill/decode world (engine/disagg_launch.py)."""
    if config.disaggregated:
        return build_disagg(config, on_engine)
    if not config.parallel_config().distributed:
        return rank_engine(config, config.parallel_config(), 0, on_engine) if on_engine else Engine(config)
    return start_ranks(config, on_engine)


def run_node(config: EngineConfig, on_engine: str | None = None) -> int:
    """A node other than 0: run its ranks until rank 0 shuts the world down; the worst exit code."""
    if config.disaggregated:
        return run_disagg_node(config, on_engine)
    pc = config.parallel_config()
    return wait_ranks(spawn_followers(config, pc, pc.dist_init_addr, on_engine))
