"""A verification round's overflow staging: the one-launch Triton kernel against the plain-PyTorch form.

    python3 bench/stage_overflow_bench.py --out $OUT/stage_overflow_h200.json       # GPU (~1 min cold)
    python3 bench/stage_overflow_bench.py --quick --out /tmp/stage.json              # CPU smoke (interpreter)

kernels/stage_overflow.py at glm5-faithful's round shape: N requests of K queries x k = 2,048 selected
positions over 102,400 positions in 64-row pages, a `--miss` share of entries placed nowhere by the plan,
queries sharing a `--shared` share of their rows. Each form is captured in a CUDA graph (as the engine's step
graphs run it) and replayed; median of `--reps` replays, and the ratio triton / torch measured in the same
run. Before timing, both forms' outputs are compared bit for bit on the same input.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.kernel_bench import Timing, timed  # noqa: E402
from dhisparse.bench.results import write_doc  # noqa: E402
from dhisparse.core.rows import SPACE  # noqa: E402
from dhisparse.kernels.stage_overflow import stage_overflow_torch, stage_overflow_triton  # noqa: E402


def case(N: int, K: int, k: int, L: int, ps: int, miss: float, shared: float, dev: str):
    g = torch.Generator().manual_seed(0)
    base = torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(N)])
    own = torch.stack([torch.stack([torch.randperm(L, generator=g)[:k] for _ in range(K)]) for _ in range(N)])
    sel = torch.where(torch.rand((N, K, k), generator=g) < shared, base[:, None], own)
    loc = torch.where(torch.rand((N, K, k), generator=g) < miss, -1, torch.randint(0, 1 << 20, (N, K, k), generator=g))
    HP = -(-L // ps)
    stage_loc = SPACE + torch.arange(N * K * k).view(N, K * k)
    table = torch.stack([torch.randperm(HP, generator=g) for _ in range(N)])
    return [t.to(dev) for t in (sel, loc, torch.arange(N), stage_loc, table)] + [ps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", default="18,47")
    ap.add_argument("--widths", default="5,8")
    ap.add_argument("--miss", type=float, default=0.3, help="share of entries the plan placed nowhere")
    ap.add_argument("--shared", type=float, default=0.7, help="share of a query's rows shared with the request's others")
    ap.add_argument("--reps", type=int, default=50)
    ns = ap.parse_args(argv)
    ns.argv = ["bench/stage_overflow_bench.py"] + list(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    k, L, ps = (16, 512, 8) if ns.quick else (2048, 102400, 64)
    runs = []
    for N in [int(x) for x in ns.requests.split(",")][: 1 if ns.quick else None]:
        for K in [int(x) for x in ns.widths.split(",")]:
            args = case(N, K, k, L, ps, ns.miss, ns.shared, dev)
            la, lb = args[1].clone(), args[1].clone()
            ref = stage_overflow_torch(args[0], la, *args[2:])
            got = stage_overflow_triton(args[0], lb, *args[2:])
            same = torch.equal(la, lb) and all(torch.equal(x, y) for x, y in zip(ref, got))
            tm, loc0 = Timing(warmup=3, reps=3 if ns.quick else ns.reps, graph=1), args[1].clone()
            reset = lambda: args[1].copy_(loc0)  # noqa: E731  (each call stages from the same locations)
            t_torch = timed(lambda: stage_overflow_torch(*args), tm, cuda, reset)
            t_triton = timed(lambda: stage_overflow_triton(*args), tm, cuda, reset)
            runs.append({"requests": N, "width": K, "k": k, "positions": L, "staged_rows": int(ref[2].sum()),
                         "equal": bool(same), "torch_ms": t_torch, "triton_ms": t_triton,
                         "triton_over_torch": t_triton / t_torch})
            print(f"N {N} K {K}: torch {t_torch * 1e3:8.1f} us  triton {t_triton * 1e3:8.1f} us  "
                  f"x{t_triton / t_torch:.3f}  equal {same}  staged {runs[-1]['staged_rows']}", flush=True)
    write_doc("stage_overflow_bench", ns, ns.out, runs=runs, device=torch.cuda.get_device_name() if cuda else "cpu",
              note="CUDA-graph replays, median; the ratio is triton / torch in the same run")
    return 0 if all(r["equal"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
