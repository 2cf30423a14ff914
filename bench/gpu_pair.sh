#!/usr/bin/env bash
# Two gpu_session.sh step lists at once on a two-GPU machine (kind nvidia-h200-x2), one per GPU:
#   bash bench/gpu_call.sh bash bench/gpu_pair.sh STEPS_GPU0 STEPS_GPU1
# Each list runs in its own process group with CUDA_VISIBLE_DEVICES set, its own result folder
# ($OUT/gpu0/, $OUT/gpu1/: two lists may run the same step, and one must not overwrite the other's
# file) and its own log ($OUT/gpu0/gpu0.log, $OUT/gpu1/gpu1.log; joined into $OUT/gpu_pair.log at the end). Each list is cut at
# PAIR_LIMIT_S seconds (default 540), so the pair ends inside one device call. Every ratio a step reports is measured inside one process on one
# GPU; the other GPU's work shares only the host (CPU cores, DRAM), which the results' notes name.
# Each process gets 8 CPU threads for torch's host ops (32 cores in all).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
(OMP_NUM_THREADS=8 CUDA_VISIBLE_DEVICES=0 LOG="$OUT/gpu0/gpu0.log" OUT="$OUT/gpu0" timeout ${PAIR_LIMIT_S:-540} bash bench/gpu_session.sh "$1" > "$OUT/gpu0.out" 2>&1) &
p0=$!
(OMP_NUM_THREADS=8 CUDA_VISIBLE_DEVICES=1 LOG="$OUT/gpu1/gpu1.log" OUT="$OUT/gpu1" timeout ${PAIR_LIMIT_S:-540} bash bench/gpu_session.sh "$2" > "$OUT/gpu1.out" 2>&1) &
p1=$!
wait $p0; wait $p1
for g in 0 1; do echo "======== GPU $g: ${@:$((g + 1)):1}"; tail -c 5500 "$OUT/gpu$g.out"; done
rm -f "$OUT/gpu0.out" "$OUT/gpu1.out"
# one log file back instead of two (the device tool returns at most 8 files)
cat "$OUT/gpu0/gpu0.log" "$OUT/gpu1/gpu1.log" > "$OUT/gpu_pair.log" 2>/dev/null && rm -f "$OUT/gpu0/gpu0.log" "$OUT/gpu1/gpu1.log"
