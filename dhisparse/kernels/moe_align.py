"""The grouped MoE GEMMs' row grouping: (token, slot) rows sorted by expert, each run padded to BM.

    moe_align(expert_ids, E, BM)        one Triton launch up to KERNEL_MAX_ROWS rows, else the torch form
    moe_align_torch(expert_ids, E, BM)  plain PyTorch, the kernel's reference (same signature and result)

    rows  [P]      | e0 rows ascending | pad M .. | e1 rows ascending | pad M .. | ... | pad M (unused) |
                   ^ 0                           ^ pend[0]                       ^ pend[E-1]         ^ P
    block_expert [P / BM]  the expert of rows b*BM .. b*BM+BM-1; E past pend[E-1]

P = padded_rows(M, E, BM) bounds every expert's count rounded up to BM, so the shapes depend on
M, E and BM only (a CUDA graph replays the same launch). An id outside [0, E) is left out.

The torch form is about 30 torch ops a MoE layer; its stable int64 radix argsort alone took 27 us a
call, 2.03 ms of a 72-ms glm5-faithful step over the step's 75 MoE layers (C20, H100,
bench/results/step_profile_round_faithful_e12_100k_k2048_c20_w8a8_indexer_s46_h100.json), and its
scans, scatters and searchsorted about 0.7 ms more. The kernel is one program: it counts
each expert's rows (a histogram a chunk), takes the padded starts by a prefix sum, fills the pads,
then places each chunk's rows at start + rows of that expert in earlier chunks (gathered from a [E]
vector) + rank among equal ids earlier in the chunk (the stable order), and writes block_expert as
searchsorted(pend, b * BM, right=True) does, as a running sum of the histogram of pend / BM.
Session 46's form built [CHUNK, E] one-hots instead: 0.11-0.56x of the torch form at E 12 / 24 but
up to 2.9x slower at GLM-5's 256 experts (bench/results/moe_align_s47_h100.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNEL_MAX_ROWS = 8192  # rows (T * top_k) up to which moe_align launches the kernel (decode, verification, small prefill)
CHUNK = 128  # rows a step of the kernel's row loops (a [CHUNK, CHUNK] rank comparison) and blocks a step of its block loop
FILL = 1024  # slots a step of the pads' fill (P reaches M + E * (BM - 1): 3,992 slots at GLM-5's E 256, BM 16, 152 rows)


def padded_rows(M: int, E: int, BM: int) -> int:
    """P_max = M + E * (BM - 1) rounded up to BM: bounds the sum of every expert's count rounded up to BM."""
    return triton.cdiv(M + E * (BM - 1), BM) * BM


def moe_align_torch(expert_ids: torch.Tensor, E: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [T, top_k] -> (sorted_rows int32 [P_max], block_expert int32 [P_max // BM]).

    sorted_rows lists the flat rows t * top_k + j grouped by expert (ascending within an expert),
    each expert's run padded with M = T * top_k (out of range: masked) to a multiple of BM and
    starting at a multiple of BM; block_expert[b] is the expert of rows b*BM .. b*BM+BM-1, or E for
    blocks past the used count. Torch ops of data-independent shapes only (no host sync). An id
    outside [0, E) is left out: its row appears nowhere."""
    flat = expert_ids.reshape(-1)
    M, dev = flat.numel(), flat.device
    P = padded_rows(M, E, BM)
    key = torch.where((flat >= 0) & (flat < E), flat, E)  # invalid ids: bucket E, never placed
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    pend = ((counts[:E] + BM - 1) // BM * BM).cumsum(0)  # [E] end of each expert's padded run
    pstart = torch.cat([pend.new_zeros(1), pend])  # [E + 1]
    ustart = counts.cumsum(0) - counts  # [E + 1] start of each expert in the sorted order
    order = torch.argsort(key, stable=True)
    skey = key[order]
    dest = pstart[skey] + torch.arange(M, device=dev) - ustart[skey]
    dest = torch.where(skey < E, dest, P)  # slot P: dropped below
    rows = torch.full((P + 1,), M, dtype=torch.int64, device=dev).scatter_(0, dest, order)[:P]
    block_expert = torch.searchsorted(pend, torch.arange(0, P, BM, device=dev), right=True)
    return rows.to(torch.int32), block_expert.to(torch.int32)


@triton.jit
def _keys(ids_ptr, i, M, E, EP: tl.constexpr):
    """Expert ids of flat rows i [CHUNK] as int32; EP (matches no expert) past M or outside [0, E)."""
    key = tl.load(ids_ptr + i, mask=i < M, other=-1)
    return tl.where((key >= 0) & (key < E), key, EP).to(tl.int32)


@triton.jit(do_not_specialize=["M", "E", "P"])  # a count of 1 would otherwise become a compile-time constant
def moe_align_kernel(ids_ptr, rows_ptr, blk_ptr, M, E, P, BM: tl.constexpr, EP: tl.constexpr, CH: tl.constexpr,
                     FILL: tl.constexpr):
    """One program: rows_ptr [P] and blk_ptr [P // BM] as `moe_align_torch` writes them (module docstring).

    Per-expert state is a [EP] vector updated by histograms (tl.histogram) and read per row by
    tl.gather, so no [CH, EP] one-hot is built: the work is O(M + P + E * nb / CH), not O(M * E)."""
    r = tl.arange(0, CH)
    counts = tl.zeros([EP], tl.int32)
    a = M * 0  # loop positions as int32 scalars
    while a < M:  # `while`: the interpreter cannot run `range` to a runtime bound (as fp8_gemm's K walk)
        key = _keys(ids_ptr, a + r, M, E, EP)
        counts += tl.histogram(key, EP, mask=key < EP)
        a += CH
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)  # [EP]: end of each expert's padded run (constant past E)
    f = tl.arange(0, FILL)
    a = M * 0
    while a < P:
        tl.store(rows_ptr + a + f, M, mask=a + f < P)
        a += FILL
    tl.debug_barrier()  # the pads are written before any row lands on them
    placed = pend - padded  # [EP]: next free slot of each expert (its start, plus rows of earlier chunks)
    a = M * 0
    while a < M:
        i = a + r
        key = _keys(ids_ptr, i, M, E, EP)
        ok = key < EP
        base = tl.gather(placed, tl.where(ok, key, 0), 0)
        rank = tl.sum(((key[:, None] == key[None, :]) & (r[None, :] < r[:, None])).to(tl.int32), axis=1)
        tl.store(rows_ptr + base + rank, i.to(tl.int32), mask=ok)
        placed += tl.histogram(key, EP, mask=ok)
        a += CH
    # block_expert[b] = searchsorted(pend[:E], b * BM, right=True) = #{e < E : pend[e] / BM <= b}: a
    # running sum over blocks of the histogram of pend / BM (pend is a multiple of BM)
    q = pend // BM
    e = tl.arange(0, EP)
    nb = P // BM
    carry = M * 0
    a = M * 0
    while a < nb:
        h = tl.histogram(q - a, CH, mask=(e < E) & (q >= a) & (q < a + CH))
        tl.store(blk_ptr + a + r, carry + tl.cumsum(h, axis=0), mask=a + r < nb)
        carry += tl.sum(h, axis=0)
        a += CH


def moe_align(expert_ids: torch.Tensor, E: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align_torch`'s result: one launch of `moe_align_kernel` up to KERNEL_MAX_ROWS rows (every
    decode and verification pass), the torch form above (a prefill chunk's rows, where one program's
    loops would be long). Called on the Triton path only (the FP8 grouped GEMMs)."""
    M = expert_ids.numel()
    if M > KERNEL_MAX_ROWS:
        return moe_align_torch(expert_ids, E, BM)
    P = padded_rows(M, E, BM)
    dev = expert_ids.device
    if M == 0:  # no rows (an expert-parallel rank without tokens): every slot a pad, every block past the used count
        return torch.zeros(P, dtype=torch.int32, device=dev), torch.full((P // BM,), E, dtype=torch.int32, device=dev)
    rows = torch.empty(P, dtype=torch.int32, device=dev)
    block_expert = torch.empty(P // BM, dtype=torch.int32, device=dev)
    ep = max(16, triton.next_power_of_2(E))
    moe_align_kernel[(1,)](expert_ids.reshape(-1).contiguous(), rows, block_expert, M, E, P, BM=BM, EP=ep, CH=CHUNK,
                           FILL=FILL, num_warps=4)
    return rows, block_expert
