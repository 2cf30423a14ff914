"""Moving a request's prompt KV from a prefill rank to a decode rank (engine/disagg.py).

Two parts, both torch.distributed:

    Header   picklable: request id, sampling params, prompt ids, first token, generator state,
             logprobs, timings, and the shape / dtype of each tensor. It rides the control round:
             the prefill rank's reply (gather to rank 0), then rank 0's next message (broadcast)
             names (prefill rank, decode rank, Header).
    tensors  point to point in that round, right after the broadcast, before anyone steps:
             [latent [L, n, W], index [F, n, Wi], features [f, hidden] by ascending layer], in the
             store's row format (model-dtype or FP8 rows, moved as stored). `dist.isend` /
             `dist.irecv` with tag = (transfer index in the round) * 256 + tensor index, over the
             gloo world on CPU, or an NCCL group on CUDA (`Wire`); every wait has the
             --dist-timeout deadline, and a failed or late one is `RankLost` naming the peer.

A DeepSeek-V4 request carries its whole prompt state instead (engine/disagg_v4.py: per-layer
windows and compressor tails, stored compressed rows, the tiered CSA rows, features), named tensors
in that module's order, with their `V4Shape` in the Header (`v4`).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import RankLost
from dhisparse.engine.disagg_kv import PromptKV
from dhisparse.engine.disagg_v4 import V4Shape, v4_prefix_of, v4_shape, v4_tensors
from dhisparse.kv.memory.prefix_store import StoredPrefix
from dhisparse.kv.v4.prefix import V4Prefix

TAGS_PER_TRANSFER = 1024  # a V4 state: a few tensors per layer


@dataclass(frozen=True)
class Header:
    """One hand-over's metadata (module docstring). specs: (name, shape, dtype) of each tensor in
    wire order ("latent", "index", then "feature:<layer>"; a V4 state: engine/disagg_v4.py's
    names); v4: a V4 state's `V4Shape` (None: rows by position); arrival_wall: `time.time()` when
    the request reached rank 0; the rest as in `PromptKV`."""

    request_id: str
    params: SamplingParams
    token_ids: tuple[int, ...]
    first_token: int
    generator_state: torch.Tensor
    specs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    imported_len: int = 0
    queue_s: float = 0.0
    sampled_wall: float = 0.0
    arrival_wall: float = 0.0
    v4: V4Shape | None = None

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for _, s, d in self.specs)


def tensors_of(kv: PromptKV) -> list[tuple[str, torch.Tensor]]:
    """kv's tensors in wire order: latent, index, then features by ascending layer (a V4 state:
    `disagg_v4.v4_tensors`)."""
    item = kv.item
    if isinstance(item, V4Prefix):
        return v4_tensors(item)
    return [("latent", item.latent), ("index", item.index),
            *((f"feature:{l}", item.features[l]) for l in sorted(item.features))]


def header_of(request_id: str, params: SamplingParams, kv: PromptKV, arrival_wall: float) -> Header:
    specs = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors_of(kv))
    v4 = v4_shape(kv.item) if isinstance(kv.item, V4Prefix) else None
    return Header(request_id, params, kv.item.token_ids, kv.first_token, kv.generator_state, specs, kv.logprobs,
                  kv.prompt_logprobs, kv.imported_len, kv.queue_s, kv.sampled_wall, arrival_wall, v4)


def prompt_kv_of(h: Header, tensors: list[torch.Tensor], pin: bool) -> PromptKV:
    """The decode side's `PromptKV` of a received hand-over (host tensors, pinned when `pin`)."""
    host = [t.cpu().pin_memory() if pin else t.cpu() for t in tensors]
    if h.v4 is not None:
        item = v4_prefix_of(h.token_ids, h.v4, {name: t for (name, _, _), t in zip(h.specs, host)})
        return PromptKV(item, h.first_token, h.generator_state, h.logprobs, h.prompt_logprobs, h.imported_len,
                        h.queue_s, h.sampled_wall)
    feats = {int(name.split(":")[1]): t for (name, _, _), t in zip(h.specs[2:], host[2:])}
    item = StoredPrefix(h.token_ids, host[0], host[1], feats, whole_prompt=True)
    return PromptKV(item, h.first_token, h.generator_state, h.logprobs, h.prompt_logprobs, h.imported_len,
                    h.queue_s, h.sampled_wall)


@dataclass(frozen=True)
class Received:
    """A hand-over that arrived on this decode rank: its header, KV, and timings (wall clock)."""

    header: Header
    kv: PromptKV
    received_wall: float
    transfer_s: float


class Wire:
    """This rank's end of the point-to-point transfers. device: where tensors travel from / land
    (cpu over gloo; a CUDA device over `group`, an NCCL group of the whole world)."""

    def __init__(self, rank: int, timeout_s: float, device: torch.device | str = "cpu", group=None) -> None:
        self.rank, self.timeout_s, self.device, self.group = rank, timeout_s, torch.device(device), group
        self.sent_bytes = self.received_bytes = 0

    def run(self, transfers: list[tuple[int, int, Header]], outgoing: dict[str, PromptKV]) -> list[Received]:
        """One round's transfers: post every send of this rank (its `outgoing` KV) and every receive,
        then wait for all of them within the deadline. Returns what this rank received, in order."""
        t0 = time.perf_counter()
        works, landing = [], []
        for i, (src, dst, h) in enumerate(transfers):
            if self.rank == src:
                for j, (_, t) in enumerate(tensors_of(outgoing[h.request_id])):
                    if t.numel():  # an empty tensor (a V4 state before its first row) is known from its spec
                        works.append((dst, self._post(dist.isend, t.to(self.device), dst, i, j)))
                    self.sent_bytes += t.numel() * t.element_size()
            elif self.rank == dst:
                bufs = [torch.empty(shape, dtype=dtype, device=self.device) for _, shape, dtype in h.specs]
                works += [(src, self._post(dist.irecv, b, src, i, j)) for j, b in enumerate(bufs) if b.numel()]
                landing.append((h, bufs))
        self._wait(works, t0)
        now, took = time.time(), time.perf_counter() - t0
        out = []
        for h, bufs in landing:
            self.received_bytes += h.nbytes
            out.append(Received(h, prompt_kv_of(h, bufs, self.device.type == "cuda"), now, took))
        return out

    def _post(self, op, t: torch.Tensor, peer: int, i: int, j: int):
        if j >= TAGS_PER_TRANSFER:
            raise ValueError(f"a hand-over has {j + 1} tensors; at most {TAGS_PER_TRANSFER} travel")
        try:
            return op(t, peer, group=self.group, tag=i * TAGS_PER_TRANSFER + j)
        except Exception as e:  # noqa: BLE001 - any transport failure is a lost peer
            raise RankLost(peer, "KV transfer", e) from e

    def _wait(self, works: list, t0: float) -> None:
        for peer, w in works:
            left = self.timeout_s - (time.perf_counter() - t0)
            try:
                if left <= 0 or not w.wait(timeout=datetime.timedelta(seconds=left)):
                    raise TimeoutError(f"no KV transfer with rank {peer} within --dist-timeout {self.timeout_s} s")
            except Exception as e:  # noqa: BLE001 - a dead or stalled peer
                raise RankLost(peer, "KV transfer", e) from e
