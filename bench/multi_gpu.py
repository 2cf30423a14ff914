"""Issue 32 on several GPUs of one host: the NCCL probe, the serving runs of parallel worlds, and the
exactness report. Prepared and smoke-tested on CPU (gloo); NOT yet run on a GPU.

    python3 bench/multi_gpu.py probe --out $OUT/nccl_probe.json                    # every GPU, NCCL (~30 s)
    python3 bench/multi_gpu.py serving --model glm5-faithful --layouts '1;dpep2' --presets hisparse \\
        --input-len 102400 --output-len 256 --per-gpu 47 --kv-pool-gib 27.4166 --host-pool-gib 24 \\
        --kv-cache-dtype fp8_e4m3 --out $OUT/multi_scale.json                      # issue 32 run 2
    python3 bench/multi_gpu.py serving --layouts 'pd1+1;dp2' --concurrency 16 ... # issue 32 run 3
    python3 bench/multi_gpu.py serving --quick --out /tmp/multi_smoke.json         # CPU smoke (gloo, tiny)
    python3 bench/multi_gpu.py merge A.json B.json --out AB.json                  # worlds of several runs compared
    python3 bench/multi_gpu.py exact-report --jsonl A.jsonl --junit A.xml --out $OUT/exact32.json

`serving` runs every (preset, layout) world in a child process of its own (a fresh CUDA context
and rendezvous; a hung or failed world is killed by its process group after --world-timeout and
reported, the next one still runs) and rewrites --out after each, so a call cut short keeps what
ran. Each world: build (rank 0 here, the others spawned) -> the oracle reference for +spec presets
(decoded in the world unless --reference-dir holds it) -> the prefix prepared on every rank (on
every prefill rank of a disaggregated world) -> warm-up -> a --duration window at the world's
concurrency -> close. Per rank (the same for every rank of every layout): the KV pool
(--kv-pool-gib, or --resident-fit histories) and its slots, sized as bench/gpu_serving.py sizes one
GPU (dhisparse.bench.sizing); a disaggregated world's host pool also holds its decode ranks' whole
received histories (dhisparse.bench.multi_sizing.host_pool_for). --per-gpu C gives each world C x
its decode GPUs clients (the scaling comparison: the same load per GPU); --concurrency C gives
every world C (the disaggregation comparison: the same load on the same GPUs).

The result file is a bench result (`dhisparse table` reads its runs, labelled preset@layout) with
`worlds` (per-GPU output, per-rank window tokens, the TTFT split, times, rank 0's device memory),
`memory` (weights per GPU under each layout, pool, host) and `comparison` (each world's per-GPU
output against the one-GPU world's, and a disaggregated world's against the colocated world of the
same GPUs). The host's NVLink multicast stays off (dhisparse.bench.multi.multicast_off).

The subcommands live beside this file: `serving` and `merge` in bench/multi_serving.py (a world's
child process: bench/multi_world.py), `probe` and `exact-report` in bench/multi_checks.py; their
library parts in dhisparse/bench/ (multi.py, multi_sizing.py, multi_report.py, nccl_probe.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.multi_checks import exact_parser, probe_parser  # noqa: E402
from bench.multi_serving import merge_parser, parse_serving, serving, serving_parser  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line (a subcommand's namespace; `serving`'s completed by `parse_serving`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    serving_parser(sub)
    merge_parser(sub)
    probe_parser(sub)
    exact_parser(sub)
    ns = p.parse_args(argv)
    ns.argv = ["bench/multi_gpu.py", *argv]
    return parse_serving(ns) if ns.func is serving else ns


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_world"]:  # a world's child process (bench/multi_world.py)
        from bench.multi_world import world_main

        return world_main(argv[1], argv[2])
    ns = parse(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
