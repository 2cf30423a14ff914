"""Persistent scratch of the Triton resolver plan (the FlashInfer-wrapper pattern: allocate once, plan many).

Per call `plan_triton` needs, per request n of a batch of N:

  scr64  [N, 2*KKP + BP] int64   out / miss keys / victims          (any contents at entry)
  scr32  [N, 2*KKP] int32        rep, flags                         (any contents at entry)
  pv     [N, LCAP] int16/int32   P1's position-indexed claims       (any contents at entry)
  bm     [2*HALF + 2] int32      P0's distinct-row bitmaps           (see below; optional map only)
  pre    [N, 3] int32            direct_pre_kernel's counts          (ZERO at entry; optional map only)
  hitf   [N, BP] int8            the hot lookup's hit flags          (any contents at entry; hot_entry only)

LCAP is the positions' bound (the host table's reach plus the tail, or the optional map's width):
pv costs 2 B per position per request (int32 only past K*k = 32,767), as much as an int16 optional
map row. Without a workspace they are allocated per call (bm and pre filled: a launch each). A
`PlanWorkspace` holds flat buffers that every call slices, and the kernels keep the invariant
themselves: pv is never cleared (the kernel accepts only cells written this call), and the plan
kernel resets its `pre` row once read.

The bitmap is two halves of HALF words, a parity word and an arrival count:

    bm:  [ half 0: HALF words | half 1: HALF words | parity | arrivals ]
    call c (parity p):  P0 sets bits in half p (request n's row at p*HALF + n*WORDS, N*WORDS <= HALF)
                        and every P0 program zeroes its share of half 1-p (all HALF words, whatever
                        the last call's layout was); the last P0 program to arrive flips the parity
                        and resets the count
    invariant between calls: the half named by the parity word is zero, the count is zero

so no pass re-reads a call's entries to clear the bits it set (that took a second grid of the plan
kernel's programs). Each buffer has its own parity word: a captured graph replaying on a grown-out
buffer and eager calls on the new one never clear each other's halves.

Buffers grow geometrically when a call needs more; a grown-out buffer is retired, not freed, because
a captured CUDA graph may still address it (its replays keep its invariant: their kernels clear what
they set). Growth never happens inside a graph capture (refused: the runners' eager warm-up grows
them first). Calls must be stream-ordered, as a store's are.
"""

from __future__ import annotations

import torch

from dhisparse.kernels import backend

__all__ = ["PlanWorkspace", "capturing"]


def capturing(dev: torch.device) -> bool:
    """Whether the current stream of `dev` is capturing a CUDA graph (never on the CPU)."""
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


class PlanWorkspace:
    """Flat persistent buffers for `plan_triton(..., workspace=ws)` on one device."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}
        self._retired: list[tuple[str, torch.Tensor]] = []  # (name, buffer): kept alive for captured graphs
        self._views: dict[tuple, tuple] = {}  # scratch() results by shape, dropped when a buffer grows
        self.generation = 0  # bumped when a buffer grows (the views, and launches bound to them, change)
        self.launches: dict = {}  # plan_triton's held launches (kernels/resolver.py `_Bound`), by call
        # plan_triton's output blocks kept for reuse (kernels/resolver_args.py `OutBlock`), by output shape: an
        # experiment (the kernel settings' plan_output_reuse, DHISPARSE_PLAN_OUTPUT_REUSE=1) until a CUDA run
        # has checked it
        self.reuse_outputs = backend.settings().plan_output_reuse
        self.outputs: dict[tuple, list] = {}
        self.outputs_reused = 0  # calls that took a kept block

    def _get(self, name: str, numel: int, dtype: torch.dtype, fill: int | None) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel:
            if capturing(self.device):
                # a buffer made inside a capture is filled only when the graph replays: eager calls
                # would read it unfilled. Graph runners warm up eagerly first, so this grows there;
                # a capture that gets here fails and its passes run eagerly (engine/step_graphs.py)
                raise RuntimeError(f"resolver workspace {name!r} must grow to {numel} entries inside a CUDA graph "
                                   "capture; run the pass once eagerly first")
            if buf is not None:
                self._retired.append((name, buf))
            self._views.clear()
            self.generation += 1
            size = max(numel, 2 * buf.numel() if buf is not None else 0, 1)
            buf = torch.empty(size, dtype=dtype, device=self.device)
            if fill is not None:
                buf.fill_(fill)
            self._bufs[name] = buf
        return buf[:numel]

    def scratch(self, N: int, KKP: int, BP: int, lcap: int, claim: torch.dtype, words: int, with_pre: bool):
        """(scr64 [N, 2*KKP + BP], scr32 [N, 2*KKP], pv [N, lcap] of dtype `claim`, bm [2*HALF + 2] (the
        two bitmap halves, parity and arrivals, HALF >= N * words), HALF, pre [N, 3] zeros); without
        `with_pre` (no optional map) bm is scr32, HALF 0 and pre None: P0's pre-pass does not run.
        Views of the persistent buffers (the same views for the same shape)."""
        key = (N, KKP, BP, lcap, claim, words, with_pre)
        hit = self._views.get(key)
        if hit is None:
            hit = self._views[key] = self._slice(*key)
        return hit

    def _slice(self, N: int, KKP: int, BP: int, lcap: int, claim: torch.dtype, words: int, with_pre: bool):
        scr64 = self._get("scr64", N * (2 * KKP + BP), torch.int64, None).view(N, 2 * KKP + BP)
        scr32 = self._get("scr32", N * 2 * KKP, torch.int32, None).view(N, 2 * KKP)
        pv = self._get(f"pv_{str(claim)[6:]}", N * lcap, claim, None).view(N, lcap)
        if not with_pre:
            return scr64, scr32, pv, scr32, 0, None
        bm, half = self._bitmap(N * words)
        pre = self._get("pre", N * 3, torch.int32, 0).view(N, 3)
        return scr64, scr32, pv, bm, half, pre

    def hit_flags(self, N: int, BP: int) -> torch.Tensor:
        """hitf [N, BP] int8 (any contents: the plan kernel clears a request's row before using it)."""
        key = ("hitf", N, BP)
        hit = self._views.get(key)
        if hit is None:
            hit = self._views[key] = self._get("hitf", N * BP, torch.int8, None).view(N, BP)
        return hit

    def _bitmap(self, need: int) -> tuple[torch.Tensor, int]:
        """(the whole bitmap buffer [2*HALF + 2], HALF) with HALF >= need words: grown (zeroed) when
        smaller. Its layout is fixed for the buffer's life, so it is never sliced to a call's size."""
        buf = self._bufs.get("bm")
        half = 0 if buf is None else (buf.numel() - 2) // 2
        if half < need:
            half = max(need, 2 * half)
            self._get("bm", 2 * half + 2, torch.int32, 0)  # retires the old buffer (graphs may hold it)
            buf = self._bufs["bm"]
            half = (buf.numel() - 2) // 2
        return buf, half

    def _named(self, *names: str) -> list[torch.Tensor]:
        return [t for name, t in [*self._bufs.items(), *self._retired] if name in names]

    def zeroed(self) -> list[torch.Tensor]:
        """What must be zero between calls: the P0 count rows (live and retired) and, of each bitmap
        buffer, the half its parity word names (the one the next call sets bits in) and its arrival
        count."""
        out = self._named("pre")
        for bm in self._named("bm"):
            half = (bm.numel() - 2) // 2
            p = int(bm[2 * half])
            out += [bm[p * half: (p + 1) * half], bm[2 * half + 1:2 * half + 2]]
        return out

    def claims(self) -> list[torch.Tensor]:
        """The claim tables (any contents between calls; tests fill them with adversarial values)."""
        return [t for name, t in [*self._bufs.items(), *self._retired] if name.startswith("pv_")]

    def nbytes(self) -> int:
        """Device bytes held (live and retired buffers)."""
        return sum(t.numel() * t.element_size() for t in self._named(*self._bufs))
