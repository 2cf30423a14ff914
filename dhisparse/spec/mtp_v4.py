"""How `MtpDrafter` (spec/mtp.py) runs a DeepSeek-V4 MTP block (`spec/mtp_v4_model.py`).

The drafter's round is the GLM / V3.2 one: the step at position q takes (x_{q+1}, g_q) and
predicts x_{q+2}; step 0 is q = n - 1 with the anchor and the target's g_{n-1}, step j >= 1 chains
the previous draft and the previous step's s'. For V4 (D = hidden, N = hc_mult, Dh = head_dim):

  * g is the target's last-layer residual streams before hc_head and the final norm, captured
    flat [rows, N * D] under key L = num_hidden_layers (`DeepseekV4ForCausalLM.forward`); the
    chained g is the block's own output streams s' [N, N * D] (vLLM feeds the same tensor).
  * a ring row is the MTP layer's attention row kv_p [Dh] (shared K = V), a function of
    (x_{p+1}, g_p) alone: committed positions get theirs from the real target features
    (`rows`), chained positions' rows are transient (never stored, so rejections need no rollback).

**Attention is exact.** V4's MTP layer is a sliding-window layer (compress ratio 0 in V4 configs):
the query at position q attends to exactly the rows of positions q - W + 1..q, W =
sliding_window, plus its per-head sink, and nothing else. The drafter keeps the last W committed
rows per request in a `LatentRing` and hands the layer, through a `V4Pass`-like `window(layer, kv)`
answer, those rows plus the round's transient rows: the same keys and values the upstream MTP
layer's own window cache would hold, for every context length (no approximation, unlike the DSA
MTP layer of GLM / V3.2 past index_topk). A smaller --speculative-draft-window-size only drops old
rows (an approximation that costs acceptance, never output: verification keeps it exact, I7).
"""

from __future__ import annotations

from typing import Callable

import torch

from dhisparse.kv.v4.passes import LocatedRows
from dhisparse.spec.config import SpecConfigError
from dhisparse.spec.mtp_v4_model import MtpV4Module

WindowFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _RingWindow:
    """The `ctx` the V4 decoder layer attends through: `window(layer, kv [N, Dh])` -> the
    drafter's window rows [R, 1, Dh] at loc [N, L] (-1 = no row)."""

    def __init__(self, fn: WindowFn) -> None:
        self.fn = fn

    def window(self, layer: int, kv: torch.Tensor) -> LocatedRows:  # noqa: ARG002 (the V4Pass signature)
        return LocatedRows(*self.fn(kv))


class MtpV4Parts:
    """The V4 block against its target `lm` (DeepseekV4ForCausalLM): what `MtpDrafter` needs.

    layer: the capture key of g (L); window: W (default and maximum: sliding_window);
    row_width: Dh; feat_width: N * D."""

    def __init__(self, module: MtpV4Module, lm, window: int | None = None) -> None:
        tcfg = lm.config
        W = tcfg.sliding_window
        if window is not None and not 1 <= window <= W:
            raise SpecConfigError(f"--speculative-draft-window-size {window}: the DeepSeek-V4 MTP layer attends its "
                                  f"sliding window of {W} rows; use at most {W} (the default, which is exact)")
        self.module = module
        self.embed = module.embed if module.embed is not None else lm.model.embed_tokens
        self.head = module.head if module.head is not None else lm.lm_head
        self.final_norm = None
        self.layer = tcfg.num_layers
        self.window = window or W
        self.row_width = tcfg.head_dim
        self.feat_width = tcfg.hc_mult * tcfg.hidden_size

    def features(self, g: torch.Tensor) -> torch.Tensor:
        """Captured g [rows, N * D] -> what the drafter keeps (unchanged: hnorm runs per step)."""
        return g.to(self.module.weight.dtype)

    def rows(self, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Committed positions: ids [T] (x_{p+1}), feats [T, N * D] (g_p), pos [T] -> kv rows [T, Dh]."""
        m = self.module
        return m.kv_rows(m.fuse(self.embed(ids), feats, pos), pos)

    def step(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, window: WindowFn):
        """One chained step for N requests: tok [N] (x_{q+1}), hidden [N, N * D] (g_q), pos [N] (q);
        `window(kv [N, Dh])` -> (rows, loc) -> (logits [N, V] fp32, next hidden s' [N, N * D])."""
        m = self.module
        out = m.run_block(m.fuse(self.embed(tok), hidden, pos), pos, tok, _RingWindow(window))
        logits = self.head(m.head_input(out).to(self.head.weight.dtype)).float()
        return logits, out.flatten(1)
