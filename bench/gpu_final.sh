#!/usr/bin/env bash
# A short device call: serving at the high and low load, a C4 profile (resident vs adaptive), a short load step.
#   bash bench/gpu_call.sh bash bench/gpu_final.sh     (carry [".whl", ".tcache"]; ~8 min)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$OUT/gpu_session.log" | grep -v "^    " | cut -c1-220 | tail -30; }
run "serving C36, C4" timeout 240 python3 bench/gpu_serving.py --concurrency 36,4 --force --out "$OUT/gpu_serving_h200.json"
run "decode-step profile C4" timeout 80 python3 bench/step_profile.py --concurrency 4 --steps 6 --warmup 3 \
    --presets resident,adaptive --kv-pool-gib 40 --host-pool-gib 8 --sync-report --out "$OUT/step_profile_c4_h200.json"
run "load step" timeout 170 python3 -m dhisparse.cli loadstep --model-path glm52-scaled-k512 --device cuda \
    --dtype bfloat16 --page-size 64 --kv-pool-bytes 9730326528 --host-pool-bytes 49715277824 \
    --max-running-requests 65 --max-model-len 8464 --input-len 8192 --output-len 256 --c-low 4 --c-high 48 \
    --low-duration 15 --high-duration 25 --after-duration 20 --no-progress --out "$OUT/loadstep_h200.json"
