"""The padded gather-copy kernel against plain indexing (TRITON_INTERPRET on CPU): ragged and empty
counts, layered row spaces, and the bounded grid whose programs step through a request's rows.

Breakages tried (each fails here): the programs' loop made a single pass (`while` -> `if`): rows past
the first P*R of a request are not copied; the layer offset dropped (g * hsl): layers 1.. get layer
0's rows.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dhisparse.kernels import gather  # noqa: E402
from dhisparse.kernels.gather import gather_programs, gather_rows_padded, row_copy  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(host: torch.Tensor, dev: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               count: torch.Tensor) -> torch.Tensor:
    """Plain indexing: dev[dst[n, r]] = host[src[n, r]] for r < count[n], in every layer."""
    out = dev.clone()
    hp, dp = host.shape[-2], dev.shape[-2]
    for n in range(src.shape[0]):
        for r in range(int(count[n])):
            s, d = int(src[n, r]), int(dst[n, r])
            out[d // dp, ..., d % dp, :] = host[s // hp, ..., s % hp, :]
    return out


def _plan(N: int, C: int, host_rows: int, dev_rows: int, counts: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.stack([torch.randperm(host_rows, generator=g)[:C] for _ in range(N)])
    dst = torch.randperm(dev_rows, generator=g)[: N * C].view(N, C)  # no row written twice
    return src, dst, torch.tensor(counts, dtype=torch.int64)


@pytest.mark.parametrize("programs", [1, 3, 1024])
@pytest.mark.parametrize("layered", [False, True])
def test_bounded_grid_copies_every_counted_row(monkeypatch, programs, layered):
    """With GATHER_PROGRAMS forcing 1 or 3 programs a (request, layer), each program steps through its
    request's rows; ragged counts (0, 1, a full capacity, one past a program's first pass)."""
    monkeypatch.setattr(gather, "GATHER_PROGRAMS", programs)
    g = torch.Generator().manual_seed(programs)
    shape = (40, 3, 4, 7) if layered else (40, 4, 7)
    host = torch.randint(0, 1000, shape, generator=g).to(torch.float32)
    dev = torch.zeros((40,) + shape[1:], dtype=torch.float32)
    C = 37
    src, dst, count = _plan(4, C, 160, 160, [0, 1, C, 17], seed=programs)
    want = _reference(host, dev, src, dst, count)
    d = dev.to(DEV)
    gather_rows_padded(host.pin_memory() if DEV == "cuda" else host, d, src.to(DEV), dst.to(DEV), count.to(DEV),
                       rows_per_prog=4)
    assert torch.equal(d.cpu(), want)


def test_empty_plans_copy_nothing():
    host = torch.ones(4, 2, 3)
    dev = torch.zeros(4, 2, 3, device=DEV)
    src = torch.zeros((0, 5), dtype=torch.int64, device=DEV)
    gather_rows_padded(host.pin_memory() if DEV == "cuda" else host, dev, src, src, torch.zeros(0, device=DEV))
    gather_rows_padded(host.pin_memory() if DEV == "cuda" else host, dev, src.view(5, 0), src.view(5, 0),
                       torch.zeros(5, device=DEV))
    assert not dev.any()


def test_grid_is_bounded_by_the_program_budget():
    assert gather_programs(2048, 16, 100, 4) == 3  # 1,024 programs over 400 (request, layer) pairs
    assert gather_programs(2048, 16, 1, 1) == 128  # one request: its whole capacity in one pass
    assert gather_programs(32, 16, 1, 1) == 2
    assert gather_programs(2048, 16, 5000, 1) == 1


def test_mismatched_row_spaces_are_refused_by_name():
    with pytest.raises(ValueError, match="dtype and width"):
        row_copy(torch.zeros(2, 2, 3), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="layer count"):
        row_copy(torch.zeros(2, 3, 2, 4), torch.zeros(2, 2, 2, 4))


@pytest.mark.parametrize("width,blocks", [(130, 2), (129, 3), (300, 3), (500, 4), (520, 5), (1300, 11)])
def test_rows_of_several_column_blocks(width, blocks):
    """Rows wider than one 64-unit column block: two to four blocks are all loaded before any store
    (`copy_row_block`), five or more go one block at a time; odd widths fall back to 4-B units. Every
    byte of every counted row lands, in both layers, and nothing else is written."""
    g = torch.Generator().manual_seed(width)
    host = torch.randint(0, 1 << 20, (24, 2, 4, width), generator=g).to(torch.float32)
    dev = torch.full((24, 2, 4, width), -1.0)
    src_rows = host.pin_memory() if DEV == "cuda" else host  # read zero-copy on CUDA: pinned
    rc = row_copy(src_rows, dev.to(DEV))
    assert -(-rc.W // rc.CW) == blocks
    assert rc.width_in_flight == rc.CW * (blocks if blocks <= 4 else 1)
    src, dst, count = _plan(3, 20, 96, 96, [20, 0, 7], seed=width)
    want = _reference(host, dev, src, dst, count)
    d = dev.to(DEV)
    gather_rows_padded(src_rows, d, src.to(DEV), dst.to(DEV), count.to(DEV))
    assert torch.equal(d.cpu(), want)
