"""SGLang's HiSparse swap-in kernel on one of our resolver cases: its state, what it must return, its launch.

The peer keeps, per request slot r (tensors indexed by `req_pool_indices`):

    device_buffer_tokens [R, H + 1] int32   the token each hot slot holds (-1: none); slot H holds the newest
    device_buffer_locs   [R, H + 1] int32   each hot slot's device row
    host_cache_locs      [R, T]     int64   each token's host row
    lru_slots            [R, H]     int16   hot slots, least recently used first

and per call a top-k [N, k] int32 of token positions and `seq_lens` [N]. It returns top_k_device_locs
[N, k] int32: a hit's slot row; the newest token (seq_len - 1) at slot H; the i-th miss in top-k order takes
the i-th least recently used slot that is not a hit, whose row it copies from host. It rewrites lru_slots
(the misses' slots before the hits', the stale slots first) and device_buffer_tokens.

`peer_state` translates a `ResolverState` (K = 1) into that form: the same hot slots, positions and rows;
host rows from the page table; recency from the stamps, oldest first, ties by slot (our victims'
(stamp, slot) order). seq_len is the history plus one, so the peer's newest token is a tail position that no
case selects. Then both resolvers see the same hits and misses, and choose the same victim slots; only the
pairing of misses to victims differs (ours by host address, the peer's by top-k order).

`peer_expected` is that contract in plain PyTorch (the check of the peer's output on the GPU and, on the CPU,
of the translation against our `plan_reference`). `PeerKernel` launches the built library
(bench/peer/build.py) through ctypes on the current stream.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dhisparse.kernels.resolver_ref import ResolverState

LIB = Path(__file__).resolve().parents[2] / ".peer" / "libhisparse_peer.so"
TOP_K = 2048  # the library's instantiation (hisparse_peer.cu)
HOT_SIZES = (4096, 8192)
# The peer's CUDA prefix sums (hisparse.cuh's warp_inclusive_scan, a 32-chunk window per iteration of NUM_WARPS
# chunks) hold only with NUM_WARPS >= 16: with 256 threads (8 warps) its offsets blow up and it writes out of
# bounds (session 50's illegal address). The library reports its block (dhs_peer_block_size); sglang serves with 960.
MIN_WARPS = 16


@dataclass
class PeerState:
    """The peer's per-request tables (module docstring) and the call's fixed inputs."""

    tokens: torch.Tensor  # [N, H + 1] int32
    locs: torch.Tensor  # [N, H + 1] int32
    host_locs: torch.Tensor  # [N, L + 1] int64
    lru: torch.Tensor  # [N, H] int16
    req: torch.Tensor  # [N] int64
    seq: torch.Tensor  # [N] int64
    num_real: torch.Tensor  # [1] int32

    def copy(self, device: str | torch.device | None = None) -> "PeerState":
        """A copy of every table, on `device` (default: where they are)."""
        return PeerState(*(getattr(self, f).to(device or getattr(self, f).device, copy=True)
                           for f in self.__dataclass_fields__))


def host_rows_of(st: ResolverState, L: int) -> torch.Tensor:
    """[N, L] int64: each position's host row (page * page_size + offset), as the plan's copy source."""
    pos = torch.arange(L, device=st.host_table.device)
    ps = st.host_page_size
    return st.host_table[:, pos // ps] * ps + pos % ps


def lru_order(stamp: torch.Tensor) -> torch.Tensor:
    """[N, H] int16: slots by (stamp, slot), oldest first (a stable sort keeps ties in slot order)."""
    return torch.sort(stamp, dim=1, stable=True).indices.to(torch.int16)


def peer_state(st: ResolverState, L: int) -> PeerState:
    """The peer's form of st for a history of L positions (module docstring). Requires every request's
    tail to start at L (so no selected position is the peer's newest token) and H <= 32,767 (int16)."""
    N, H = st.hot_pos.shape
    if H > 32767 or not bool((st.tail_start == L).all()):
        raise ValueError(f"peer_state: H {H} must fit int16 and every tail must start at L {L}")
    if L + 1 <= H:  # seq_len <= H: the peer's short-sequence path (slots indexed by position), not this contract
        raise ValueError(f"peer_state: history {L} + 1 must exceed H {H} (the peer's fast path otherwise)")
    i32 = dict(dtype=torch.int32, device=st.hot_pos.device)
    tokens = torch.cat([st.hot_pos.to(torch.int32), torch.full((N, 1), L, **i32)], 1)
    locs = torch.cat([st.hot_loc.to(torch.int32), st.tail_loc[:, :1].to(torch.int32)], 1)
    host = torch.cat([host_rows_of(st, L), torch.zeros((N, 1), dtype=torch.int64, device=st.hot_pos.device)], 1)
    dev = st.hot_pos.device
    return PeerState(tokens.contiguous(), locs.contiguous(), host.contiguous(), lru_order(st.hot_stamp).contiguous(),
                     torch.arange(N, dtype=torch.int64, device=dev), torch.full((N,), L + 1, dtype=torch.int64, device=dev),
                     torch.tensor([N], dtype=torch.int32, device=dev))


def peer_expected(ps: PeerState, top_k: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(top_k_device_locs [N, k] int32, each request's victim slots in miss order) that the peer's contract
    gives on ps (not modified). Distinct positions per request (a top-k)."""
    N, k = top_k.shape
    H = ps.lru.shape[1]
    out = torch.empty((N, k), dtype=torch.int32)
    victims = []
    for n in range(N):
        r, newest = int(ps.req[n]), int(ps.seq[n]) - 1
        where = {int(t): s for s, t in enumerate(ps.tokens[r, :H].tolist()) if t >= 0}
        sel = top_k[n].tolist()
        hit = [t == newest or t in where for t in sel]
        hit_slots = {where[t] for t in sel if t in where and t != newest}
        stale = [s for s in ps.lru[r].tolist() if s not in hit_slots]
        v, m = [], 0
        for i, t in enumerate(sel):
            if t == newest:
                out[n, i] = ps.locs[r, H]
            elif hit[i]:
                out[n, i] = ps.locs[r, where[t]]
            else:
                v.append(stale[m])
                out[n, i] = ps.locs[r, stale[m]]
                m += 1
        victims.append(torch.tensor(v, dtype=torch.int64))
    return out, victims


class PeerKernel:
    """The built library (bench/peer/build.py): `run` launches one call on the current CUDA stream."""

    def __init__(self, lib: Path = LIB):
        if not lib.exists():
            raise FileNotFoundError(f"{lib}: build it with `python3 bench/peer/build.py` and carry .peer/")
        self.lib = ctypes.CDLL(str(lib))
        self.fn = self.lib.dhs_peer_load
        self.fn.restype = ctypes.c_int
        meta = lib.parent / "build.json"
        self.build = json.loads(meta.read_text()) if meta.exists() else {}
        try:
            self.block = int(self.lib.dhs_peer_block_size())
        except AttributeError:
            raise RuntimeError(f"{lib}: no dhs_peer_block_size (a build from before the 960-thread launch): "
                               "rebuild with `python3 bench/peer/build.py`") from None
        if self.block % 32 or self.block // 32 < MIN_WARPS or self.block > 1024:
            raise RuntimeError(f"{lib}: block {self.block}: the peer's scans need {MIN_WARPS}..32 warps")

    def run(self, ps: PeerState, top_k: torch.Tensor, out: torch.Tensor, host: torch.Tensor, dev: torch.Tensor,
            item_bytes: int, skip_io: bool = False) -> None:
        """One call: top_k [N, 2048] int32 (contiguous rows), out [N, 2048] int32; host / dev: the row spaces
        (any shape; rows of item_bytes, linear). skip_io: the plan alone (the peer's copy compiled out)."""
        H = ps.lru.shape[1]
        if H not in HOT_SIZES or top_k.shape[1] != TOP_K or top_k.dtype != torch.int32 or out.dtype != torch.int32:
            raise ValueError(f"PeerKernel.run: built for H in {HOT_SIZES}, top-k {TOP_K} int32; got H {H}, "
                             f"top_k {tuple(top_k.shape)} {top_k.dtype}")
        check_args(ps, top_k, out, host, dev, item_bytes)
        p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
        i64 = ctypes.c_int64
        rc = self.fn(ctypes.c_int(H), ctypes.c_int(int(skip_io)), p(top_k), p(ps.tokens), p(ps.host_locs), p(ps.locs),
                     p(host), p(dev), p(out), p(ps.req), p(ps.seq), p(ps.lru), p(ps.num_real), i64(top_k.shape[0]),
                     i64(ps.tokens.stride(0)), i64(ps.host_locs.stride(0)), i64(ps.lru.stride(0)),
                     i64(top_k.stride(0)), i64(out.stride(0)), i64(1), i64(item_bytes),
                     ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"hisparse peer launch failed: {rc}")


def check_args(ps: PeerState, top_k: torch.Tensor, out: torch.Tensor, host: torch.Tensor, dev: torch.Tensor,
               item_bytes: int) -> None:
    """What `load_cache_to_device_buffer_kernel` assumes of its arguments, from their shapes, dtypes, devices
    and strides alone (no values read: no sync, so it can sit in a timed call). Raises ValueError."""
    N, H = top_k.shape[0], ps.lru.shape[1]
    bad = []
    dtypes = {"tokens": torch.int32, "locs": torch.int32, "host_locs": torch.int64, "lru": torch.int16,
              "req": torch.int64, "seq": torch.int64, "num_real": torch.int32}
    for f, dt in dtypes.items():
        t = getattr(ps, f)
        if t.dtype != dt:
            bad.append(f"{f} {t.dtype} (wants {dt})")
        if t.device != top_k.device:
            bad.append(f"{f} on {t.device}, top_k on {top_k.device}")
        if t.numel() and t.stride(-1) != 1:
            bad.append(f"{f} last stride {t.stride(-1)}")
    for name, t in (("top_k", top_k), ("out", out), ("dev", dev)):
        if t.device.type != "cuda" or t.device != top_k.device:
            bad.append(f"{name} on {t.device} (wants the CUDA device of top_k)")
    R = ps.tokens.shape[0]
    if ps.tokens.dim() != 2 or ps.tokens.shape[1] != H + 1 or ps.locs.shape != ps.tokens.shape:
        bad.append(f"tokens {tuple(ps.tokens.shape)} / locs {tuple(ps.locs.shape)} (want [R, H + 1 = {H + 1}])")
    if ps.locs.stride(0) != ps.tokens.stride(0):  # one buffer_stride_0 serves both
        bad.append(f"tokens / locs row strides {ps.tokens.stride(0)} / {ps.locs.stride(0)} differ")
    if ps.lru.dim() != 2 or ps.lru.shape[0] != R or ps.host_locs.dim() != 2 or ps.host_locs.shape[0] != R:
        bad.append(f"lru {tuple(ps.lru.shape)} / host_locs {tuple(ps.host_locs.shape)} (want [R = {R}, ...])")
    if ps.req.shape != (N,) or ps.seq.shape != (N,) or ps.num_real.numel() < 1:
        bad.append(f"req {tuple(ps.req.shape)} / seq {tuple(ps.seq.shape)} (want [{N}]), num_real "
                   f"{tuple(ps.num_real.shape)}")
    if top_k.dim() != 2 or top_k.stride(1) != 1 or out.shape != top_k.shape or out.stride(1) != 1:
        bad.append(f"top_k {tuple(top_k.shape)} / out {tuple(out.shape)} (want equal [N, k], unit last stride)")
    if host.device.type == "cpu" and not host.is_pinned():  # read by the device through its UVA address
        bad.append("host rows in pageable CPU memory (want pinned, or CUDA)")
    elif host.device.type not in ("cpu", "cuda"):
        bad.append(f"host rows on {host.device}")
    for name, t in (("host", host), ("dev", dev)):
        row = t.shape[-1] * t.element_size() if t.dim() else 0
        if not t.is_contiguous() or row != item_bytes:
            bad.append(f"{name} rows {tuple(t.shape)} {t.dtype}: not linear rows of {item_bytes} B")
        if t.data_ptr() % 16:
            bad.append(f"{name} base not 16-B aligned")
    if item_bytes <= 0 or item_bytes % 16:  # 16-B vector loads / stores per row (hisparse.cuh transfer_item_warp)
        bad.append(f"item_bytes {item_bytes} (wants a positive multiple of 16)")
    if bad:
        raise ValueError("PeerKernel.run: " + "; ".join(bad))
