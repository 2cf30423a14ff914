"""`moe_align`'s kernel (kernels/moe_align.py: one program groups a MoE layer's (token, slot) rows by
expert) against its plain-PyTorch reference `moe_align_torch`: the same sorted rows and block experts,
bit for bit, over odd, ragged and empty shapes, invalid ids and many chunks (hypothesis; the
interpreter on CPU). tests/test_fp8_gemm.py checks the invariants both must hold against plain Python.
Breakages caught (mutation runs, session 46): the rank counting a row itself (`<=`), the experts' next
free slots not advanced between chunks, block_expert counting ends strictly below a block's start
(`<`), the id E taken as valid, and the torch form's bound doubled; after the histogram form (session
47): the block loop's running sum not carried between chunks (or not advanced), its histogram
taking experts past E or a block past its chunk, the counts taking the id E, and the free slots not
advanced by a chunk's histogram. The barrier between the pads' fill
and the rows' stores is not checked here: the interpreter runs a program's stores in order (the
CUDA run of this file and the FP8 MoE files checks the kernel on the GPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import dhisparse.kernels.moe_align as ma  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@settings(max_examples=60, deadline=None)
@given(E=st.integers(1, 40), top_k=st.integers(1, 8), BM=st.sampled_from([16, 32, 64]),
       T=st.sampled_from([0, 1, 2, 3, 19, 20, 47, 90, 200]), invalid=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_equals_the_torch_form(E, top_k, BM, T, invalid, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-1, E + 1) if invalid else (0, E)
    ids = torch.randint(lo, hi, (T, top_k), generator=g).to(DEV)
    got, want = ma.moe_align(ids, E, BM), ma.moe_align_torch(ids, E, BM)
    assert got[0].dtype == got[1].dtype == torch.int32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_skewed_and_single_expert_loads():
    """Every row on one expert (a run of many chunks), and every expert but one empty."""
    for E, ids in ((1, torch.zeros(300, 2, dtype=torch.int64)), (64, torch.full((150, 8), 63)),
                   (8, torch.tensor([[0, 7, 7]] * 50))):
        ids = ids.to(DEV)
        got, want = ma.moe_align(ids, E, 16), ma.moe_align_torch(ids, E, 16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@settings(max_examples=12, deadline=None)
@given(E=st.sampled_from([128, 160, 255, 256]), T=st.sampled_from([1, 19, 47, 90]), BM=st.sampled_from([16, 64]),
       invalid=st.booleans(), seed=st.integers(0, 2**16))
def test_many_experts(E, T, BM, invalid, seed):
    """GLM-5's 256 experts (and E just past a power of two): block_expert spans several of the block
    loop's chunks (its running sum carried between them), most experts empty, ids E and -1 left out."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-1, E + 1) if invalid else (0, E)
    ids = torch.randint(lo, hi, (T, 8), generator=g).to(DEV)
    got, want = ma.moe_align(ids, E, BM), ma.moe_align_torch(ids, E, BM)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_large_groupings_take_the_torch_form(monkeypatch):
    """Above KERNEL_MAX_ROWS rows (a prefill chunk) the torch form runs, not the kernel's one program."""
    calls = []
    monkeypatch.setattr(ma, "moe_align_torch", lambda *a: calls.append(a[0].numel()) or ma.padded_rows(0, 1, 16))
    monkeypatch.setattr(ma, "KERNEL_MAX_ROWS", 12)
    ma.moe_align(torch.zeros(6, 2, dtype=torch.int64, device=DEV), 4, 16)
    assert calls == []
    ma.moe_align(torch.zeros(13, 1, dtype=torch.int64, device=DEV), 4, 16)
    assert calls == [13]
