"""Parallel layout of an engine over several processes (torch.distributed), and its control channel.

Flags are SGLang's: `--dp-size`, `--tp-size`, `--enable-dp-attention`, `--ep-size`, `--nnodes`,
`--node-rank`, `--dist-init-addr`, plus `--dist-timeout` (seconds, every collective's deadline).

Built today: data parallelism, alone or with expert-parallel MoE, and tensor parallelism alone.
Rank r runs its own `Engine`: its own scheduler and its own KV hierarchy (pools, host store, hot
caches, residency). Ranks exchange one control message a step over a gloo group
(`ControlChannel`); with expert parallelism the MoE layers also exchange tokens (`exchange`),
with tensor parallelism the layers sum their partial outputs (`tp_sum`).

    --dp-size N                                    world N, weights replicated, each rank its own
                                                   requests (the paper's per-GPU session)
    --tp-size N --dp-size N --enable-dp-attention --ep-size N
                                                   world N, attention data-parallel, experts
                                                   sharded N ways (SGLang's DP attention + EP)
    --tp-size N                                    world N, every rank the same requests in
                                                   lock-step, heads / intermediate sizes sharded
                                                   N ways (layers/tp.py), MLA latent KV replicated
    rank r: device cuda:(r mod ranks per node); node k of nnodes runs ranks [k * n, (k + 1) * n)

Refused with the flag named: DP x TP (--dp-size > 1 with --tp-size > 1 and no DP attention),
--ep-size without --enable-dp-attention, attention TP under DP attention (dp < tp) and MoE TP
(ep < tp).

Under prefill/decode disaggregation with `--ep-size E` (engine/disagg_layout.py) the exchange and
the lock-step (`any_rank`) run over the rank's EP group of its role (`join_ep_groups`), not the world.

`RankLost` is what every failed or timed-out collective becomes: the caller sees which rank and
which operation, never a hang past `timeout_s`; `agree` turns ranks that disagree on a few
integers (under TP: a step's batch) into one too.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run; the message names the flag."""


class RankLost(RuntimeError):
    """A peer rank died, stalled past the deadline, or a collective failed."""

    def __init__(self, rank: int | None, op: str, cause: BaseException | None = None) -> None:
        who = "a peer rank" if rank is None else f"rank {rank}"
        why = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"{who} is lost during {op}{why}")
        self.rank, self.op = rank, op


@dataclass(frozen=True)
class ParallelConfig:
    """The process layout (SGLang's flag names): world_size = tp_size with DP attention (dp = ep =
    tp), else dp_size x tp_size (one of them 1: DP alone or TP alone)."""

    dp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous; None: 127.0.0.1 and a free port
    timeout_s: float = 300.0  # EngineConfig.dist_timeout_s's default

    def __post_init__(self) -> None:
        for name, flag in (("dp_size", "--dp-size"), ("tp_size", "--tp-size"), ("ep_size", "--ep-size"),
                           ("nnodes", "--nnodes")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{flag} must be an integer >= 1; got {v!r}")
        self._check_mesh()
        if not 0 <= self.node_rank < self.nnodes:
            raise ParallelConfigError(f"--node-rank must be in [0, --nnodes {self.nnodes}); got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ParallelConfigError(f"--nnodes {self.nnodes} must divide the world size {self.world_size}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ParallelConfigError("--nnodes > 1 needs --dist-init-addr host:port (rank 0's address)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ParallelConfigError(f"--dist-init-addr must be host:port; got {self.dist_init_addr!r}")
        if not self.timeout_s > 0:
            raise ParallelConfigError(f"--dist-timeout must be > 0 seconds; got {self.timeout_s}")

    def _check_mesh(self) -> None:
        """The layouts built: DP (tp = ep = 1), TP alone (dp = ep = 1, no DP attention), and DP
        attention over the whole TP group with experts sharded over it (tp = dp = ep,
        --enable-dp-attention)."""
        if self.enable_dp_attention:
            if not self.tp_size == self.dp_size == self.ep_size:
                raise ParallelConfigError(
                    f"--enable-dp-attention with --tp-size {self.tp_size} --dp-size {self.dp_size} --ep-size {self.ep_size}: "
                    "only attention fully data-parallel with experts sharded over every rank is built "
                    "(--tp-size N --dp-size N --ep-size N); attention TP and MoE TP are not built yet")
            return
        if self.ep_size != 1:
            raise ParallelConfigError(
                f"--ep-size {self.ep_size}: expert parallelism runs with DP attention "
                "(--tp-size N --dp-size N --enable-dp-attention --ep-size N); tensor parallelism alone is --tp-size N")
        if self.tp_size != 1 and self.dp_size != 1:
            raise ParallelConfigError(
                f"--tp-size {self.tp_size} with --dp-size {self.dp_size}: DP x TP is not built; tensor parallelism "
                "alone is --tp-size N (--dp-size 1), data parallelism alone --dp-size N, DP attention + EP "
                "--tp-size N --dp-size N --enable-dp-attention --ep-size N")

    @property
    def world_size(self) -> int:
        return self.tp_size if self.enable_dp_attention else self.dp_size * self.tp_size

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def tensor_parallel(self) -> bool:
        """TP alone: every rank runs the same requests with its shard of the weights."""
        return self.tp_size > 1 and not self.enable_dp_attention

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def local_ranks(self) -> range:
        """Global ranks this node runs."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    def device_of(self, rank: int, device: str) -> str:
        """The device a rank runs on: `cuda` becomes cuda:(rank's index on its node); cpu stays.
        ValueError when the node has fewer GPUs than the ranks it runs (a rank past them would fail
        later with CUDA's "invalid device ordinal")."""
        if device in ("cuda", "auto") and torch.cuda.is_available():
            index, gpus = rank % self.ranks_per_node, torch.cuda.device_count()
            if index >= gpus:
                raise ValueError(f"this node runs {self.ranks_per_node} ranks (--dp-size / --tp-size / --ep-size, "
                                 f"disaggregation sizes, over --nnodes {self.nnodes}) but has {gpus} GPU(s): one GPU a "
                                 "rank; give fewer ranks or --device cpu")
            return f"cuda:{index}"
        return device


_DATA_GROUP: list = [None]  # the MoE exchange's / TP sums' group: NCCL on CUDA, else the gloo world (None)
_STEP_GROUP: list = [None]  # `any_rank`'s gloo group: the world (None), or this rank's EP group of a role


def init_rank(pc: ParallelConfig, rank: int, init_addr: str, device: str = "cpu") -> None:
    """Join the world as `rank`: gloo for control (no accelerator needed); with expert or tensor
    parallelism on CUDA also an NCCL group for the MoE's token exchange / the TP sums."""
    timeout = datetime.timedelta(seconds=pc.timeout_s)
    dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=pc.world_size, timeout=timeout)
    if (pc.expert_parallel or pc.tensor_parallel) and device.startswith("cuda"):
        _DATA_GROUP[0] = dist.new_group(backend="nccl", timeout=timeout)


def join_ep_groups(blocks: list[range], rank: int, device: str, timeout_s: float) -> None:
    """After `init_rank`: every rank creates, in the order given, one subgroup per block of global
    ranks (gloo; on CUDA also NCCL), and keeps its own block's as the MoE exchange's data group
    (NCCL on CUDA, else the gloo one) and `any_rank`'s lock-step group (gloo). Every rank must pass
    the same blocks (a torch.distributed rule for new_group); each rank lies in exactly one."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for block in blocks:
        step = dist.new_group(list(block), backend="gloo", timeout=timeout)
        data = dist.new_group(list(block), backend="nccl", timeout=timeout) if device.startswith("cuda") else step
        if rank in block:
            _STEP_GROUP[0], _DATA_GROUP[0] = step, data


def leave() -> None:
    """Leave the world (a no-op when not joined)."""
    _DATA_GROUP[0] = _STEP_GROUP[0] = None
    if dist.is_initialized():
        dist.destroy_process_group()


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank of the lock-step group (one all-reduce over the gloo world,
    or over this rank's EP group of a disaggregated role: `join_ep_groups`); RankLost on failure."""
    t = torch.tensor([int(flag)], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_STEP_GROUP[0])
    except Exception as e:  # noqa: BLE001
        raise RankLost(None, "all_reduce", e) from e
    return bool(t.item())


def exchange(rows: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    """All-to-all of the rows of `rows` [n, ...]: the first send_counts[0] to rank 0, the next to
    rank 1, ... of the data group (the world, or this rank's EP group: `join_ep_groups`); returns
    (the rows received, in source-rank order, and how many from each rank). Counts travel first
    (int64), then the payload with uneven splits (zero allowed)."""
    group = _DATA_GROUP[0]
    world = dist.get_world_size(group)
    dev = rows.device
    try:
        sc = torch.tensor(send_counts, dtype=torch.int64, device=dev)
        rc = torch.empty(world, dtype=torch.int64, device=dev)
        dist.all_to_all_single(rc, sc, group=group)
        recv_counts = rc.tolist()
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, list(send_counts), group=group)
    except Exception as e:  # noqa: BLE001
        raise RankLost(None, "all_to_all", e) from e
    return out, recv_counts


def tp_sum(x: torch.Tensor) -> torch.Tensor:
    """x [...] (this rank's partial) -> the sum of every rank's x, in rank order: all-gather, then
    ((x_0 + x_1) + x_2) + ... elementwise. The same bits on every rank, and a row's sum never
    depends on the other rows (a ring all-reduce's association follows the tensor's chunking for
    more than 2 ranks: batch-variant); for 2 ranks it moves the bytes of a ring all-reduce, for N
    ranks N/2 times as many. RankLost on failure or past the deadline."""
    group = _DATA_GROUP[0]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, x, group=group)
    except Exception as e:  # noqa: BLE001
        raise RankLost(None, "the tensor-parallel sum (all_gather)", e) from e
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def agree(values: list[int], what: str) -> None:
    """Every rank passes the same number of int64 `values`; all-gathered over the gloo world. When
    any rank's differ from rank 0's, every rank (each sees all of them) raises RankLost naming
    the first such rank and `what`, at this same collective: no rank runs on into unmatched ones."""
    t = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(parts, t)
    except Exception as e:  # noqa: BLE001
        raise RankLost(None, what, e) from e
    bad = [r for r, p in enumerate(parts) if not torch.equal(p, parts[0])]
    if bad:
        raise RankLost(bad[0], what, RuntimeError(
            f"rank {bad[0]} disagrees with rank 0: {parts[bad[0]].tolist()} != {parts[0].tolist()}"))


class ControlChannel:
    """Rank 0 -> every rank: one picklable message (`broadcast`); every rank -> rank 0: one
    picklable reply each (`gather`), torch.distributed's object collectives over the gloo world.
    Failures and timeouts raise `RankLost`."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def broadcast(self, message: Any = None) -> Any:
        """Rank 0 passes `message`; every rank returns it."""
        try:
            box = [message if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        except Exception as e:  # noqa: BLE001 - any transport failure is a lost peer
            raise RankLost(0 if self.rank else None, "broadcast", e) from e

    def gather(self, reply: Any) -> list[Any] | None:
        """Every rank passes its reply; rank 0 returns them in rank order, the others None."""
        out = [None] * self.world if self.rank == 0 else None
        try:
            dist.gather_object(reply, out, dst=0)
        except Exception as e:  # noqa: BLE001 - any transport failure is a lost peer
            raise RankLost(None if self.rank == 0 else 0, "gather", e) from e
        return out
