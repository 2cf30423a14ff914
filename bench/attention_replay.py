"""Sparse-MLA attention replayed on a live engine's inputs (`step_profile.py --attention-replay`).

The one-layer bench (`mla_tune_bench.py`) draws random rows from one row space. In the engine a
72-token verification pass took 89 us a layer against the bench's 54 us at the same T. The replay
found the cause (attention_replay_32k_c18_s11c_h200.json): the round reads two row spaces (arena
and staging), and the kernel divided each location by the two spaces' runtime rows-per-page in
int64; one space took 51 us on the same locations. With rows per page compile-time constants the
round's pass takes 43 us a layer (..._s11d_h200.json). This replays
the engine's own inputs: one eager step is run with `MLAttention.sparse` recording its arguments
(q_abs [T, H, C], q_pe [T, H, R], the row spaces, loc [T, k]) for the first `layers` calls, then each
recorded call is timed from CUDA-graph replays (as `kernel_bench.timed`) under:

  engine       the recorded inputs, the shipped plan
  sorted       each token's locations sorted (the same rows in address order)
  one_space    locations of the second row space (staging) folded into the first (timing only)
  random       k random locations per token in the first space (the bench's pattern)
  plan <cfg>   the recorded inputs under the sweep's other launch configurations

and the inputs are described: T, k, share of -1 and of staging locations, and for passes whose
requests run K tokens, the share of a request's K x k locations that are distinct.
"""

from __future__ import annotations

import contextlib
import os

import torch

from bench import mla_tune_bench as tune
from bench.kernel_bench import Timing, timed
from dhisparse.core.rows import SPACE

# (splits, block_k, warps, stages) of the plans timed besides the shipped one: on CUDA a smaller
# grid than mla_tune_bench's; on CPU (the interpreter) one configuration
SWEEP = {True: ([0, 128], [16, 32, 64], [4, 8], [1, 2]), False: ([0], [16], [4], [2])}


@contextlib.contextmanager
def recording(layers: int):
    """Patch `MLAttention.sparse` to keep (q_abs, q_pe, rows, loc, scale, fmt) of its first `layers` calls."""
    from dhisparse.layers.attention import MLAttention

    calls: list[tuple] = []
    orig = MLAttention.sparse

    def sparse(self, q_abs, q_pe, rows, loc, fmt=None):
        if len(calls) < layers:
            calls.append((q_abs.clone(), q_pe.clone(), rows, loc.clone(), self.scale, fmt))
        return orig(self, q_abs, q_pe, rows, loc, fmt)

    MLAttention.sparse = sparse
    try:
        yield calls
    finally:
        MLAttention.sparse = orig


def describe(loc: torch.Tensor, per_request: int) -> dict:
    """loc [T, k] -> shares of empty / staging locations and of distinct locations per request."""
    T, k = loc.shape
    valid = loc >= 0
    n = max(1, int(valid.sum()))
    out = {"T": T, "k": k, "empty_share": 1 - n / max(1, T * k), "staging_share": int((loc >= SPACE).sum()) / n}
    if per_request > 1 and T % per_request == 0:
        groups = loc.view(T // per_request, per_request * k)
        distinct = sum(int(torch.unique(g[g >= 0]).numel()) for g in groups)
        out["distinct_share_per_request"] = distinct / n
    return out


def variants(q_abs, q_pe, rows, loc) -> dict[str, tuple]:
    """The input variants of the module docstring (same q; rows / loc changed)."""
    spaces = (rows,) if isinstance(rows, torch.Tensor) else tuple(rows)
    first = spaces[0]
    n0 = first.shape[0] * first.shape[1]
    srt = torch.where(loc >= 0, loc, torch.iinfo(loc.dtype).max).sort(dim=1).values
    srt = torch.where(srt == torch.iinfo(loc.dtype).max, -1, srt)
    one = torch.where(loc >= SPACE, (loc - SPACE) % n0, loc)
    g = torch.Generator(device=loc.device).manual_seed(0)
    rnd = torch.randint(0, n0, loc.shape, generator=g, device=loc.device)
    return {"engine": (rows, loc), "sorted": (rows, srt), "one_space": (first, one), "random": (first, rnd)}


def replay(step, preset: str, spec_width: int, layers: int = 3) -> list[dict]:
    """Record `layers` attention calls of one `step()` and time them (module docstring). Needs
    CUDA tensors, or TRITON_INTERPRET=1 on CPU (the kernel runs in the interpreter)."""
    from dhisparse.kernels.sparse_mla import plan_sparse_mla, run_sparse_mla

    with recording(layers) as calls:
        step()
    if not calls:
        raise RuntimeError("attention replay recorded no call: the step ran from CUDA graphs; "
                           "profile with --cuda-graphs none")
    cuda = calls[0][0].is_cuda
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("attention replay times the Triton kernel: run on CUDA, or set TRITON_INTERPRET=1 on CPU")
    timing = Timing(warmup=2, reps=10, graph=10) if cuda else Timing(warmup=1, reps=2, graph=1)
    per_request = spec_width if preset.endswith("+spec") else 1
    out = []
    for i, (q, qp, rows, loc, scale, fmt) in enumerate(calls):
        H, C, R = q.shape[1], q.shape[2], qp.shape[2]
        shipped = plan_sparse_mla(H, C, R, dtype=q.dtype)
        rec = {"call": i, **describe(loc, per_request), "ms": {}}
        for name, (r, lc) in variants(q, qp, rows, loc).items():
            o = torch.empty_like(q)
            rec["ms"][name] = timed(lambda: run_sparse_mla(shipped, q, qp, r, lc, scale, fmt, out=o), timing, cuda)
        for plan in tune.plans(H, C, R, *SWEEP[cuda], dtype=q.dtype):
            if plan == shipped:
                continue
            o = torch.empty_like(q)
            key = f"plan split{plan.split_rows} bk{plan.block_k} w{plan.num_warps} s{plan.num_stages}"
            rec["ms"][key] = timed(lambda: run_sparse_mla(plan, q, qp, rows, loc, scale, fmt, out=o), timing, cuda)
        out.append(rec)
        best = min(rec["ms"], key=rec["ms"].get)
        print(f"    attention replay call {i}: T={rec['T']} staging {rec['staging_share']:.2f} "
              + " ".join(f"{k} {1e3 * v:.1f}us" for k, v in list(rec["ms"].items())[:4]) + f"; best {best}", flush=True)
    return out
