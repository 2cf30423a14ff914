"""Persistent scratch of the Triton resolver plan (the FlashInfer-wrapper pattern: allocate once, plan many).

Per call `plan_triton` needs, per request n of a batch of N:

  scr64  [N, 2*KKP + BP] int64   out / miss keys / victims          (any contents at entry)
  scr32  [N, 3*KKP + BP] int32   rep, flags, leftovers, protection  (any contents at entry)
  tab    [N, 2*HT] int64         P1's dedup tables (packed keys)    (-1 at entry)
  bm     [N, WORDS] int32        P0's distinct-row bitmap            (ZERO at entry)
  pre    [N, 3] int32            direct_pre_kernel's counts          (ZERO at entry)

Without a workspace they are allocated per call (tab, bm and pre filled: a launch each). A
`PlanWorkspace` holds flat buffers that every call slices, and the kernels keep the invariant
themselves: the plan kernel clears the buckets its dedup rounds wrote and the bitmap words its
request's entries set, and resets its `pre` row once read. Buffers grow geometrically when a call
needs more; a grown-out buffer is retired, not freed, because a captured CUDA graph may still
address it (its replays keep its invariant: their kernels clear what they set). Growth never
happens inside a graph capture (refused: the runners' eager warm-up grows them first). Calls must
be stream-ordered, as a store's are.
"""

from __future__ import annotations

import torch

__all__ = ["PlanWorkspace"]


class PlanWorkspace:
    """Flat persistent buffers for `plan_triton(..., workspace=ws)` on one device."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}
        self._retired: list[tuple[str, torch.Tensor]] = []  # (name, buffer): kept alive for captured graphs
        self._views: dict[tuple, tuple] = {}  # scratch() results by shape, dropped when a buffer grows

    def _get(self, name: str, numel: int, dtype: torch.dtype, fill: int | None) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a buffer made inside a capture is filled only when the graph replays: eager calls
                # would read it unfilled. Graph runners warm up eagerly first, so this grows there;
                # a capture that gets here fails and its passes run eagerly (engine/step_graphs.py)
                raise RuntimeError(f"resolver workspace {name!r} must grow to {numel} entries inside a CUDA graph "
                                   "capture; run the pass once eagerly first")
            if buf is not None:
                self._retired.append((name, buf))
            self._views.clear()
            size = max(numel, 2 * buf.numel() if buf is not None else 0, 1)
            buf = torch.empty(size, dtype=dtype, device=self.device)
            if fill is not None:
                buf.fill_(fill)
            self._bufs[name] = buf
        return buf[:numel]

    def scratch(self, N: int, KKP: int, BP: int, HT: int, words: int, with_pre: bool):
        """(scr64 [N, 2*KKP + BP], scr32 [N, 3*KKP + BP], tab [N, 2*HT] all -1, bm [N, words] zeros,
        pre [N, 3] zeros or None) as views of the persistent buffers (the same views for the same shape)."""
        key = (N, KKP, BP, HT, words, with_pre)
        hit = self._views.get(key)
        if hit is None:
            hit = self._views[key] = self._slice(N, KKP, BP, HT, words, with_pre)
        return hit

    def _slice(self, N: int, KKP: int, BP: int, HT: int, words: int, with_pre: bool):
        scr64 = self._get("scr64", N * (2 * KKP + BP), torch.int64, None).view(N, 2 * KKP + BP)
        scr32 = self._get("scr32", N * (3 * KKP + BP), torch.int32, None).view(N, 3 * KKP + BP)
        tab = self._get("tab", N * 2 * HT, torch.int64, -1).view(N, 2 * HT)
        bm = self._get("bm", N * words, torch.int32, 0).view(N, words)
        pre = self._get("pre", N * 3, torch.int32, 0).view(N, 3) if with_pre else None
        return scr64, scr32, tab, bm, pre

    def _named(self, *names: str) -> list[torch.Tensor]:
        return [t for name, t in [*self._bufs.items(), *self._retired] if name in names]

    def zeroed(self) -> list[torch.Tensor]:
        """The buffers that must be zero between calls (bitmap and P0 counts, live and retired)."""
        return self._named("bm", "pre")

    def emptied(self) -> list[torch.Tensor]:
        """The buffers that must be all -1 between calls (the dedup tables, live and retired)."""
        return self._named("tab")

    def nbytes(self) -> int:
        """Device bytes held (live and retired buffers)."""
        return sum(t.numel() * t.element_size() for t in self._named(*self._bufs))
