#!/usr/bin/env bash
# Issue 32 on a machine of several GPUs of one host (device kinds nvidia-h200-x2 / -x4 / -x8), in priority
# order; each step writes its JSON (command, machine, date, commit) under $OUT and a failure does not stop
# later steps. Prepared and smoke-tested on CPU (gloo); NOT yet run on a GPU. From the repo root:
#   DHISPARSE_COMMIT=<short hash> bash bench/gpu_call.sh bash bench/gpu_multi.sh STEPS   (carry [".whl", ".tcache"])
# (the device copy has no .git: DHISPARSE_COMMIT stamps the results and keys the oracle references.)
# steps: probe32, exact32, scale32, disagg32   (default: probe32,exact32). Budgets (guesses until the first call):
#   probe32 ~1 min; exact32 ~4-6 min (32 worlds of ~10-15 s, two at a time per GPU pair; x4 / x8 more pairs, and the 2+2 worlds);
#   scale32 ~6-7 min for ONE preset (SCALE_PRESETS); disagg32 ~5 min for ONE preset (DISAGG_PRESETS).
# NVLink multicast stays off (the device machines' rule): exported here for every process, and
# bench/multi_gpu.py refuses to run when any of the three is set otherwise.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-probe32,exact32}
LOG=${LOG:-$OUT/gpu_multi.log}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
GPUS=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
X=x$GPUS
run() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$LOG" | grep -v "^    " | cut -c1-220 | tail -25; }
echo "gpus $GPUS; commit ${DHISPARSE_COMMIT:-unset}; multicast off: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee -a "$LOG"
case ",$STEPS," in *,probe32,*)  # topology, NCCL version, /dev/shm, and NCCL all-reduce / uneven all-to-all / point-to-point
  # on every GPU, checked and timed (the all-reduce's bus bandwidth, one pair's send: the KV hand-off's path) (~1 min)
  run "nvidia-smi" nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader
  run "NCCL probe, $GPUS GPUs" timeout 200 python3 bench/multi_gpu.py probe --out "$OUT/nccl_probe_$X.json" ;; esac
case ",$STEPS," in *,exact32,*)  # issue 32 run 1: tests/test_parallel_cuda.py on CUDA + NCCL: DP2, DP2+EP2, TP2 and 1 prefill + 1 decode
  # worlds against one GPU, every preset, tiny and tiny-code (EXACT32_MODELS), float32 (bf16 ties: the test's docstring), the
  # row checker on every rank. ${EXACT32_PER_PAIR:-2} pytest processes per GPU pair (DHISPARSE_PARALLEL_SHARD: tiny worlds leave
  # the GPUs idle most of the time, so two worlds share a pair), and on 4+ GPUs the 2+2 (EP2 per role) worlds on GPUs 0-3 at
  # the same time. Each process is stopped (SIGINT: its JUnit file is still written) at EXACT32_S. One JUnit file and one
  # JSON (every case; a divergence with its position and the one-GPU run's logprob margin) under $OUT.
  NP=$(( GPUS / 2 )); NP=$(( NP > 4 ? 4 : NP )); NS=$(( NP * ${EXACT32_PER_PAIR:-2} ))
  for k in $(seq 0 $(( NS - 1 ))); do
    pair=$(( k % NP ))
    (CUDA_VISIBLE_DEVICES=$(( 2 * pair )),$(( 2 * pair + 1 )) DHISPARSE_PARALLEL_SHARD=$k/$NS DHISPARSE_PARALLEL_LAYOUTS=dp2,dpep2,tp2,pd1+1 \
     DHISPARSE_PARALLEL_MODELS=${EXACT32_MODELS:-tiny,tiny-code} DHISPARSE_PARALLEL_JSON="$OUT/exact32_part$k.jsonl" \
     timeout -s INT ${EXACT32_S:-420} python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_parallel_cuda.py -rfE \
     --junitxml="$OUT/exact32_part$k.xml" > "$OUT/exact32_part$k.out" 2>&1) &
  done
  if [ "$GPUS" -ge 4 ]; then
    (CUDA_VISIBLE_DEVICES=0,1,2,3 DHISPARSE_PARALLEL_LAYOUTS=pd2+2ep2 DHISPARSE_PARALLEL_MODELS=${EXACT32_MODELS:-tiny,tiny-code} \
     DHISPARSE_PARALLEL_JSON="$OUT/exact32_partpd.jsonl" timeout -s INT ${EXACT32_S:-420} python3 -m pytest -q -p no:cacheprovider -n 0 \
     tests/test_parallel_cuda.py -rfE --junitxml="$OUT/exact32_partpd.xml" > "$OUT/exact32_partpd.out" 2>&1) &
  fi
  wait
  for f in "$OUT"/exact32_part*.out; do echo "-- $f"; tail -12 "$f"; cat "$f" >> "$LOG"; done
  run "exactness report" python3 bench/multi_gpu.py exact-report --jsonl "$OUT"/exact32_part*.jsonl --junit "$OUT"/exact32_part*.xml \
      --junit-out "$OUT/exact32_$X.xml" --out "$OUT/exact32_$X.json"
  rm -f "$OUT"/exact32_part* ;; esac  # one JSON and one JUnit file back (the device tool returns at most 8 files)
case ",$STEPS," in *,scale32,*)  # issue 32 run 2: glm5-faithful, ${SCALE_LEN:-102400} tokens, FP8 rows, DP attention + EP on every GPU against one GPU,
  # ${SCALE_C:-32} clients a GPU, 256-token outputs, a 30-s window, ONE preset a call (SCALE_PRESETS; the oracle for +spec).
  # Memory a GPU (dhisparse.bench.multi.weight_bytes_per_gpu; the routed experts are 63.3 of the 83.6 GiB of FP8 weights):
  #   one GPU 83.6 GiB weights; EP2 20.3 + 63.3/2 = 51.9; EP4 36.1; EP8 28.2 GiB; + the same KV pool a rank: faithful31's
  #   27.4-GiB budget holds 5 resident 100K FP8 histories of 5.16 GiB, so the pool is 25.8 GiB (54 hierarchy sessions of
  #   0.47 GiB; slots 50 a rank) = 109.4 / 77.7 / 61.9 / 54.0 GiB before activations, of the H200's ~139 GiB usable: 100K
  #   fits every layout, one GPU included, so the context is 100K; the EP layouts leave 32-55 GiB unused (kept equal for
  #   a per-GPU comparison). Host a rank: the 100K prefix once (4.9 GiB) + 16 MiB a session -> --host-pool-gib 24.
  # Order: the one-GPU world (GPU 0) side by side with the smaller EP worlds on disjoint GPUs (x4: EP2 on GPUs 1-2;
  # x8: EP2 on 1-2 and EP4 on 4-7; they share the host's CPUs and DRAM, noted in the results), then EP on every GPU;
  # one merged file. Each world ~3 min (build ~40 s, the 100K prefix on every rank ~85 s, warm-up, 30-s window).
  # EP worlds run without CUDA graphs; SCALE_GRAPHS=none runs the one-GPU world eagerly too (like for like).
  SP=${SCALE_PRESETS:-hisparse}; SPN=${SP//+/_}
  SARGS=(--model glm5-faithful --presets "$SP" --input-len ${SCALE_LEN:-102400} --output-len 256 --duration ${SCALE_S:-30}
         --per-gpu ${SCALE_C:-32} --kv-cache-dtype fp8_e4m3 --kv-pool-gib 27.4166 --host-pool-gib 24 --max-batched-tokens 8192
         --cuda-graphs ${SCALE_GRAPHS:-auto} --world-timeout ${SCALE_WORLD_S:-250})
  (CUDA_VISIBLE_DEVICES=0 timeout 265 python3 bench/multi_gpu.py serving "${SARGS[@]}" --layouts 1 \
     --out "$OUT/scale32_part_one.json" > "$OUT/scale32_part_one.out" 2>&1) &
  if [ "$GPUS" -ge 4 ]; then
    (CUDA_VISIBLE_DEVICES=1,2 timeout 265 python3 bench/multi_gpu.py serving "${SARGS[@]}" --layouts dpep2 \
       --out "$OUT/scale32_part_ep2.json" > "$OUT/scale32_part_ep2.out" 2>&1) &
  fi
  if [ "$GPUS" -ge 8 ]; then
    (CUDA_VISIBLE_DEVICES=4,5,6,7 timeout 265 python3 bench/multi_gpu.py serving "${SARGS[@]}" --layouts dpep4 \
       --out "$OUT/scale32_part_ep4.json" > "$OUT/scale32_part_ep4.out" 2>&1) &
  fi
  wait
  for f in "$OUT"/scale32_part_*.out; do echo "-- $f"; grep "^\[" "$f" | tail -8; cat "$f" >> "$LOG"; done
  if [ "$GPUS" -ge 2 ]; then
    run "scale: $SP, EP on $GPUS GPUs" timeout 265 python3 bench/multi_gpu.py serving "${SARGS[@]}" --layouts dpep$GPUS \
        --out "$OUT/scale32_part_ep$GPUS.json"
  fi
  run "scale: merged" python3 bench/multi_gpu.py merge "$OUT"/scale32_part_*.json --out "$OUT/scale32_${SPN}_$X.json"
  rm -f "$OUT"/scale32_part_* ;; esac
case ",$STEPS," in *,disagg32,*)  # issue 32 run 3: the paper's prefill/decode layout shrunk to the machine (1P+1D on x2, 2P+2D on x4,
  # 4P+4D on x8; EP over each role as the paper's E = P = D, DISAGG_EP=0 for none) against colocated serving on the same GPUs
  # (dp2; dpep4 / dpep8, or dp4 / dp8 without EP) at the same load: ${DISAGG_C:-16} clients a decode GPU in both. glm5-faithful,
  # ${DISAGG_LEN:-32768} tokens, FP8 rows, 256-token outputs, a 30-s window, ONE preset a call (DISAGG_PRESETS, default adaptive).
  # Output per decode GPU and per GPU, TTFT split into allocation wait (prefill queue + the decode rank's wait for pages) and
  # hand-off (prefill, the round's lag, the KV transfer), per request and summed (Table A2).
  # Why 32K: a decode rank receives each request's whole prompt KV (1.66 GiB of FP8 rows at 32K; 5.16 at 100K) and keeps a
  # host-first session's history on its host with no shared prefix pages, so its host pool holds 1.25 x its sessions'
  # histories: 20 x 1.66 = 33.2 GiB + the 1.6-GiB prefix = 34.8 GiB a decode rank at 32K; prefill ranks pin only the
  # colocated sizing (--disaggregation-prefill-host-pool-bytes: the shared prefix and their in-flight prompts), so x8
  # pins 4 x 34.8 + 4 x ~3 GiB. At 100K a decode rank needs ~108 GiB: DISAGG_LEN=102400 fits x2 (~114 GiB) and x4
  # (~228 GiB), not x8 (~456 of 560 GiB), and its worlds take longer (the 100K prefix on every prefill rank).
  # The colocated worlds need 3 GiB a rank (shared prefix pages). Device per GPU: 83.6 GiB weights (51.9 / 36.1 with EP2 /
  # EP4 per role; 36.1 / 28.2 colocated under EP4 / EP8) + a 26.6-GiB pool (16 resident 32K histories). Each world ~2-2.5
  # min (build, the prefix on every prefill rank ~30 s, warm-up, window).
  DP=${DISAGG_PRESETS:-adaptive}; DPN=${DP//+/_}
  H=$(( GPUS / 2 ))
  if [ "${DISAGG_EP:-1}" = 1 ] && [ "$H" -gt 1 ]; then LAYS="pd$H+${H}ep$H;dpep$GPUS"; else LAYS="pd$H+$H;dp$GPUS"; fi
  run "disaggregation: $DP, $LAYS" timeout 580 python3 bench/multi_gpu.py serving --model glm5-faithful --presets "$DP" \
      --layouts "$LAYS" --input-len ${DISAGG_LEN:-32768} --output-len 256 --duration ${DISAGG_S:-30} --concurrency $(( ${DISAGG_C:-16} * H )) \
      --kv-cache-dtype fp8_e4m3 --kv-pool-gib 27.4166 --max-batched-tokens 8192 --world-timeout ${DISAGG_WORLD_S:-270} \
      --out "$OUT/disagg32_${DPN}_$X.json" ;; esac
