"""Hooks a spawned rank runs on its engine (`engine/launch.py` on_engine="dist_hooks:NAME")."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kv_check import checked


def row_checker(engine, rank: int) -> None:
    """Every location the rank's store returns is checked against a dense mirror (I2)."""
    checked(SimpleNamespace(engine=engine))


def stale_rows_on_rank1(engine, rank: int) -> None:
    """A breakage for the checker: rank 1's store points each selected row at its neighbour's
    location; the row checker on that rank must catch it (rank 0 then sees the rank lost)."""
    if rank == 1:
        orig = engine.store.context

        def context(batch, reqs):
            ctx = orig(batch, reqs)
            inner = ctx.locate

            def locate(layer, selection):
                rows, loc = inner(layer, selection)
                return rows, torch.where(loc >= 0, torch.roll(loc, 1, dims=-1).clamp(min=0), loc)

            ctx.locate = locate
            return ctx

        engine.store.context = context
    row_checker(engine, rank)
