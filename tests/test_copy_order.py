"""bench/copy_order.py (issue 33's copy-order measurement): its CPU smoke shapes run, both orders of a plan
copy the right rows, and its check fails on a copy that leaves a row out."""

from __future__ import annotations

import argparse

import torch

from bench import copy_order


def _quick() -> argparse.Namespace:
    return argparse.Namespace(quick=True, region_gib=1 / 64, history=512, batches=[2, 3], misses=[5, 16], row_bytes=[656],
                              iters=1, warmup=0)


def test_both_orders_copy_the_plans_rows():
    body = copy_order.run(_quick())
    assert len(body["records"]) == 4
    for r in body["records"]:
        assert r["host"]["copies_right"] and r["selection"]["copies_right"]
        assert r["bytes"] == r["batch"] * r["misses"] * 656


def test_the_check_catches_a_row_left_out():
    """On CUDA the copy kernel reads pinned host rows into device rows (plan on the device), as the
    benchmark runs it; on the CPU everything stays on the CPU (TRITON_INTERPRET)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(1)
    region = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    if dev.type == "cuda":
        region = region.pin_memory()
    host = region[: (region.numel() // (656 * 64)) * 64 * 656].view(torch.float16).view(-1, 64, 328)
    src = copy_order.plan_rows(host.shape[0], 64, 2, 512, 8, g, torch.device("cpu")).to(dev)
    dst = torch.arange(16, device=dev).view(2, 8)
    dev_rows = torch.empty((1, 64, 328), dtype=torch.float16, device=dev)
    assert copy_order.copies_right(host, dev_rows, src, dst, torch.full((2,), 8, device=dev))
    assert not copy_order.copies_right(host, dev_rows, src, dst, torch.tensor([8, 7], device=dev))
