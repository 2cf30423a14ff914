"""The NCCL probe of a host's GPUs (gloo on CPU; issue 32, bench/multi_gpu.py `probe`).

One process a rank: an all-reduce, an uneven all-to-all and a point-to-point ring, each checked;
a timed all-reduce of `mib` MiB (its bus bandwidth) and one pair's send (the KV hand-off's path).

    run_probe(world, device, mib)   every rank's results (rank order), or why there are none
    probe_ok(ranks)                 every check passed on every rank
    host_info(cuda)                 NCCL's version and variables, the GPU topology, /dev/shm
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time


def _p2p_pair(dist, big, rank: int, n: int, sync) -> dict:
    """Ranks 0 and 1: one send of `big` 0 -> 1, timed over three calls after one warm-up."""
    res: dict = {}
    peer = 1 - rank
    for i in range(4):
        t0 = time.perf_counter()
        w = dist.isend(big, peer) if rank == 0 else dist.irecv(big, peer)
        w.wait(timeout=datetime.timedelta(seconds=60))
        sync()
        if i:
            res.setdefault("p2p_ms", []).append(1e3 * (time.perf_counter() - t0))
    res["p2p_gbs"] = n * 2 / (min(res["p2p_ms"]) / 1e3) / 1e9
    return res


def _checks(torch, dist, rank: int, world: int, dev, sync) -> dict:
    """The all-reduce, the uneven all-to-all and the point-to-point ring, each checked."""
    res: dict = {}
    t = torch.full((4,), rank + 1, dtype=torch.int64, device=dev)
    dist.all_reduce(t)
    res["all_reduce_ok"] = t.tolist() == [world * (world + 1) // 2] * 4
    send = [r + 1 for r in range(world)]  # rank -> r gets r + 1 rows of value 100 * rank + r
    rows = torch.cat([torch.full((n, 3), 100 * rank + r, dtype=torch.float32, device=dev) for r, n in enumerate(send)])
    recv = [rank + 1] * world
    got = torch.empty(sum(recv), 3, dtype=torch.float32, device=dev)
    dist.all_to_all_single(got, rows, recv, send)
    want = torch.cat([torch.full((rank + 1, 3), 100 * s + rank, dtype=torch.float32, device=dev) for s in range(world)])
    res["all_to_all_uneven_ok"] = bool(torch.equal(got, want))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out, inb = torch.full((5,), float(rank), device=dev), torch.empty(5, device=dev)
    works = [dist.isend(out, nxt, tag=7), dist.irecv(inb, prv, tag=7)]
    for w in works:
        w.wait(timeout=datetime.timedelta(seconds=60))
    sync()
    res["p2p_ring_ok"] = bool((inb == prv).all())
    return res


def probe_rank(rank: int, world: int, addr: str, device: str, mib: int, q) -> None:
    """One rank of the probe; rank 0 puts every rank's results (or one rank's error) on `q`."""
    import torch
    import torch.distributed as dist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    try:
        res = _checks(torch, dist, rank, world, dev, sync)
        n = mib * (1 << 20) // 2
        big = torch.ones(n, dtype=torch.bfloat16, device=dev)
        dist.all_reduce(big)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(big)
        sync()
        s = (time.perf_counter() - t0) / 5
        res["all_reduce_ms"] = 1e3 * s
        res["all_reduce_busbw_gbs"] = 2 * (world - 1) / world * n * 2 / s / 1e9
        if world >= 2 and rank in (0, 1):  # one pair's point-to-point (the KV hand-off's path)
            res.update(_p2p_pair(dist, big, rank, n, sync))
        dist.barrier()
        parts = [None] * world
        dist.all_gather_object(parts, res)
        if rank == 0:
            q.put(parts)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the probe must return
        q.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def host_info(cuda: bool) -> dict:
    """NCCL's version and the NCCL / PyTorch / NVSHMEM variables set, `nvidia-smi topo -m`, /dev/shm."""
    import torch

    info = {"nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "NVSHMEM_", "TORCH_SYMM"))}}
    for cmd in (["nvidia-smi", "topo", "-m"], ["df", "-h", "/dev/shm"]):
        try:
            info[" ".join(cmd)] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            info[" ".join(cmd)] = f"unavailable: {e}"
    return info


def run_probe(world: int, device: str, mib: int) -> list[dict] | str:
    """Every rank in a spawned process; their results in rank order, or a string saying why none came."""
    import multiprocessing as mp

    from dhisparse.engine.rank_spawn import free_addr

    ctx, addr = mp.get_context("spawn"), free_addr()
    q = ctx.Queue()
    procs = [ctx.Process(target=probe_rank, args=(r, world, addr, device, mib, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        ranks = q.get(timeout=300)
    except Exception as e:  # noqa: BLE001
        ranks = f"no answer: {type(e).__name__}"
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return ranks


def probe_ok(ranks) -> bool:
    """Every rank answered and passed every check."""
    return isinstance(ranks, list) and all(r.get("all_reduce_ok") and r.get("all_to_all_uneven_ok") and r.get("p2p_ring_ok")
                                           for r in ranks)
