#!/usr/bin/env bash
# One device call's worth of GPU checks and measurements, in priority order; each step writes under
# $OUT and a failure does not stop later steps. Usage on the GPU machine, from the repo root:
#   bash bench/gpu_session.sh [steps]   steps: any of kernels,exact,resolver,serving (default: all)
# The repo's .whl/ (transformers==5.24.0) must be carried for the HF-parity tests.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-kernels,exact,resolver,serving}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
run() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$OUT/gpu_session.log"; }
case ",$STEPS," in *,kernels,*)
  run "kernel tests (CUDA)" timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_mla_kernel.py \
      tests/test_indexer_kernel.py tests/test_resolver_kernel.py ;; esac
case ",$STEPS," in *,exact,*)
  run "exactness on CUDA" timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_hierarchy.py \
      tests/test_adaptive.py tests/test_spec_engine.py tests/test_engine.py ;; esac
case ",$STEPS," in *,resolver,*)
  run "resolver microbenchmark" timeout 240 python3 bench/resolver_bench.py --out "$OUT/resolver_bench_h200.json" ;; esac
case ",$STEPS," in *,serving,*)
  run "serving curves" timeout 560 python3 bench/gpu_serving.py --duration 15 --out "$OUT/gpu_serving_h200.json" ;; esac
