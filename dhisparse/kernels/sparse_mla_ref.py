"""Plain-PyTorch reference of sparse latent attention (the contract of `kernels/sparse_mla.py`)."""

from __future__ import annotations

import torch

from dhisparse.core.kvformat import RowFormat
from dhisparse.core.rows import gather_rows


def sparse_mla_reference(
    q_abs: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, loc: torch.Tensor, scale: float,
    fmt: RowFormat | None = None, chunk_elems: int = 1 << 24,
) -> torch.Tensor:
    """Sparse latent attention, plain PyTorch.

    q_abs [T, H, C], q_pe [T, H, R], rows [P, per_page, W] (a paged row space; flat
    location l is rows[l // per_page, l % per_page]) or a tuple of such spaces (see
    `gather_rows`), stored in `fmt` (None or plain: W = C + R values; FP8: W bytes, decoded
    to the model dtype with `fmt.decode`), loc [T, k] (-1 = skip) -> [T, H, C].
    A token with no valid location gets zeros (only padding tokens can have none).
    """
    T, H, C = q_abs.shape
    out = q_abs.new_zeros(T, H, C)
    if T == 0:
        return out
    k = loc.shape[1]
    width = (rows if isinstance(rows, torch.Tensor) else rows[0]).shape[-1]
    step = max(1, chunk_elems // max(1, k * width))
    for a in range(0, T, step):
        b = min(T, a + step)
        lc = loc[a:b]
        valid = lc >= 0
        g = gather_rows(rows, lc.clamp(min=0))  # [S, k, W]
        if fmt is not None and fmt.fp8:
            g = fmt.decode(g)  # [S, k, C+R]
        c, kpe = g[..., :C], g[..., C:]
        logit = torch.einsum("shc,skc->shk", q_abs[a:b].float(), c.float())
        logit = logit + torch.einsum("shr,skr->shk", q_pe[a:b].float(), kpe.float())
        logit = (logit * scale).masked_fill(~valid[:, None, :], float("-inf"))
        p = torch.softmax(logit, dim=-1).nan_to_num(0.0)
        out[a:b] = torch.einsum("shk,skc->shc", p, c.float()).to(out.dtype)
    return out
