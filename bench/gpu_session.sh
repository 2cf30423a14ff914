#!/usr/bin/env bash
# One device call's worth of GPU checks and measurements, in priority order; each step writes under
# $OUT and a failure does not stop later steps. On the GPU machine, from the repo root:
#   bash bench/gpu_call.sh bash bench/gpu_session.sh [steps]    (carry [".whl", ".tcache"])
# steps: any of locality,kernels,exact,profile,profile4,graphs,stepgraphs,resolver,serving,realdraft,budget,loadstep,
#        serving32k,serving32kmid,backupahead,hoststep,quick,serving8k,serving8k25,serving8kwarm,
#        specprofile,specprofile2,serving32kc18,profile4step,specprofile32k,specprofile8ko,mlatune,specprofile32ksplit,
#        specprofile32kfast,specprofile8kfast,attnreplay32k,exactplain,serving32kload,serving32k2k,serving32k2ks,
#        sweep32khi,sweep32klo,serving100k,serving100klo,serving100k2k,serving100kmid,k2048hi,k2048curve,k2048lo,k2048mid,specprofile100kk,servewarmup,
#        exactall,draftercost,retest15,decodepages,mtptest,fp8kernels,fp8test,fp8serving100k,exactfp8,fp8spec100k,fp8profile100k,prefetch100k,train29model,train29draft,decodepagesrot,hostfirst27,
#        train29drafter,tinyspec,exactint,exactfiles,specpolicy,staging26,world1,costed31,fp8w31,faithful31,faithful41,mla64,costedfaithful31,costedsweep31,round31,round44,topk31,exact42,exact44,exact45,locality31,gemm43,w8a843,diversity31,settle31,settle41,exact33,exact33r,probe33,prims33,ncu33,peer33,peerlive33,multi33,lowload31,loadstep31,fig4_31,fig10_31,stage49,budget31,widths31,step33,copyorder33,indexer46,dflashattn46,moealign46,mlasplit47,costedsweep48,
#        fig5v41a,fig5v41b,fig5v41c,fig5v41d,fig5v41e,fig5v41f,fig5v41g,drafter34
# (default: kernels,profile,serving).
# Budget the steps to one call (<= 10 min): kernels ~1.5 min with a warm Triton cache, exact ~4 min,
# profile ~2 min, resolver ~1.5 min, serving ~6 min (its own estimate is printed first), loadstep ~5 min.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${1:-kernels,profile,serving}
LOG=${LOG:-$OUT/gpu_session.log}
run() { echo "== $1"; shift; "$@" 2>&1 | tee -a "$LOG" | grep -v "^    " | cut -c1-200 | tail -25; }
case ",$STEPS," in *,locality,*)  # calibrate the scaled model's selection locality in bf16 at 8K (~1 min)
  run "selection locality" timeout 150 python3 bench/locality.py --device cuda --dtype bfloat16 --layers 78 \
      --prompt-len 8192 --offsets 3 --gains 4,8,16 --hot 2 --out "$OUT/locality_h200.json" ;; esac
case ",$STEPS," in *,kernels,*)
  run "kernel tests (CUDA)" timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_sparse_mla_kernel.py \
      tests/test_indexer_kernel.py tests/test_resolver_kernel.py ;; esac
case ",$STEPS," in *,exact,*)
  run "exactness on CUDA" timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_hierarchy.py \
      tests/test_adaptive.py tests/test_spec_engine.py tests/test_engine.py tests/test_graphs.py tests/test_uva.py tests/test_step_graphs.py tests/test_loads.py tests/test_prefix_pages.py \
      -v --durations=15 ;; esac
case ",$STEPS," in *,profile,*)
  run "decode-step profile" timeout 270 python3 bench/step_profile.py --concurrency 24 --steps 6 --warmup 3 \
      --kv-pool-gib 40 --host-pool-gib 24 --sync-report --out "$OUT/step_profile_h200.json" ;; esac
case ",$STEPS," in *,profile4,*)  # low load: resident vs adaptive, each in its own process (~1 min)
  run "decode-step profile C4" timeout 120 python3 bench/step_profile.py --concurrency 4 --steps 6 --warmup 3 \
      --presets resident,adaptive,hisparse --kv-pool-gib 40 --host-pool-gib 8 --sync-report --out "$OUT/step_profile_c4_h200.json" ;; esac
case ",$STEPS," in *,graphs,*)
  run "decode-step profile, piecewise graphs vs eager" timeout 300 python3 bench/step_profile.py --concurrency 24 \
      --steps 5 --warmup 3 --presets resident,hisparse --kv-pool-gib 40 --host-pool-gib 24 --cuda-graphs none,layer \
      --out "$OUT/step_profile_graphs_h200.json" ;; esac
case ",$STEPS," in *,stepgraphs,*)  # piecewise vs whole-step graphs at C36 and C4; unprofiled host share (~3 min)
  run "decode-step profile, layer vs step graphs" timeout 300 python3 bench/step_profile.py --concurrency 36 --steps 6 \
      --warmup 3 --presets hisparse,adaptive,resident --kv-pool-gib 40 --host-pool-gib 24 --cuda-graphs layer,step \
      --out "$OUT/step_profile_step_c36_h200.json" ;; esac
case ",$STEPS," in *,hoststep,*)  # whole-step graphs only: the unprofiled host share at C36 (~2 min)
  run "decode-step profile, step graphs, C36" timeout 240 python3 bench/step_profile.py --concurrency 36 --steps 6 \
      --warmup 3 --presets hisparse,adaptive,resident --kv-pool-gib 40 --host-pool-gib 24 --cuda-graphs step \
      --out "$OUT/step_profile_host_c36_h200.json" ;; esac
case ",$STEPS," in *,quick,*)  # the CUDA tests of this session's changes (pinned pools, device tables) (~1.5 min)
  run "quick CUDA checks" timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_uva.py tests/test_pinned.py \
      tests/test_hier_tables.py tests/test_hierarchy.py ;; esac
case ",$STEPS," in *,resolver,*)
  run "resolver microbenchmark" timeout 300 python3 bench/resolver_bench.py --fig8bc --out "$OUT/resolver_bench_h200.json"
  rm -f "$OUT"/resolver_bench_h200_fig8bc.png ;; esac  # drawn locally from the JSON (the tool returns 8 files)
case ",$STEPS," in *,specprofile,*)  # where a verification round's time goes, at serving8k's pools and C36 (~3 min)
  run "decode-step profile, serving pools, C36, with verification" timeout 300 python3 bench/step_profile.py \
      --concurrency 36 --steps 6 --warmup 3 --presets hisparse,adaptive,adaptive+spec --kv-pool-gib 9.1 \
      --host-pool-gib 32 --cuda-graphs step --out "$OUT/step_profile_serving_c36_h200.json" ;; esac
case ",$STEPS," in *,specprofile32k,*)  # a full-width (K = 4) verification round at 32K C18, serving32kc18's pools (~4 min)
  run "decode-step profile, 32K serving pools, C18, full-width rounds" timeout 330 python3 bench/step_profile.py \
      --input-len 32768 --concurrency 18 --steps 6 --warmup 3 --presets hisparse,adaptive,adaptive+spec --drafter oracle \
      --kv-pool-gib 8.805 --host-pool-gib 92 --cuda-graphs step --out "$OUT/step_profile_32k_c18_h200.json" ;; esac
case ",$STEPS," in *,specprofile8ko,*)  # the same at 8K C36 (specprofile's pools) (~2.5 min)
  run "decode-step profile, 8K serving pools, C36, full-width rounds" timeout 240 python3 bench/step_profile.py \
      --concurrency 36 --steps 6 --warmup 3 --presets hisparse,adaptive+spec --drafter oracle --kv-pool-gib 9.1 \
      --host-pool-gib 32 --cuda-graphs step --out "$OUT/step_profile_8k_c36_oracle_h200.json" ;; esac
case ",$STEPS," in *,mlatune,*)  # sparse-MLA launch configurations (split rows, block_k, warps, stages) under CUDA graphs (~4 min)
  run "sparse-MLA launch configurations" timeout 250 python3 bench/mla_tune_bench.py --out "$OUT/mla_tune_h200.json" ;; esac
case ",$STEPS," in *,specprofile32ksplit,*)  # specprofile32k with attention split into 128-row chunks (~4 min)
  run "decode-step profile, 32K C18, split rows 128" timeout 330 env DHISPARSE_MLA_SPLIT_ROWS=128 python3 bench/step_profile.py \
      --input-len 32768 --concurrency 18 --steps 6 --warmup 3 --presets hisparse,adaptive+spec --drafter oracle \
      --kv-pool-gib 8.805 --host-pool-gib 92 --cuda-graphs step --out "$OUT/step_profile_32k_c18_split128_h200.json" ;; esac
case ",$STEPS," in *,attnreplay32k,*)  # attention timed on the engine's own inputs at 32K C18, eager steps (~4 min)
  run "attention replay, 32K C18" timeout 330 python3 bench/step_profile.py --input-len 32768 --concurrency 18 \
      --steps 2 --warmup 2 --presets hisparse,adaptive+spec --drafter oracle --kv-pool-gib 8.805 --host-pool-gib 92 \
      --cuda-graphs none --attention-replay 3 --out "$OUT/attention_replay_32k_c18_h200.json" ;; esac
case ",$STEPS," in *,specprofile8kfast,*)  # specprofile8ko with attention split into 128-row chunks and grouped indexer scoring (~2.5 min)
  run "decode-step profile, 8K C36, split rows 128 + grouped indexer" timeout 240 env DHISPARSE_MLA_SPLIT_ROWS=128 DHISPARSE_INDEXER_GROUP=1 \
      python3 bench/step_profile.py --concurrency 36 --steps 6 --warmup 3 --presets hisparse,adaptive+spec --drafter oracle \
      --kv-pool-gib 9.1 --host-pool-gib 32 --cuda-graphs step --out "$OUT/step_profile_8k_c36_fast_h200.json" ;; esac
case ",$STEPS," in *,specprofile32kfast,*)  # specprofile32ksplit plus grouped indexer scoring for verification passes (~4 min)
  run "decode-step profile, 32K C18, split rows 128 + grouped indexer" timeout 330 env DHISPARSE_MLA_SPLIT_ROWS=128 DHISPARSE_INDEXER_GROUP=1 python3 bench/step_profile.py \
      --input-len 32768 --concurrency 18 --steps 6 --warmup 3 --presets hisparse,adaptive+spec --drafter oracle \
      --kv-pool-gib 8.805 --host-pool-gib 92 --cuda-graphs step --out "$OUT/step_profile_32k_c18_fast_h200.json" ;; esac
case ",$STEPS," in *,specprofile100kk,*)  # k 2,048 at 100K C18 (k2048curve's pools): a step and a full-width round (~7 min)
  run "decode-step profile, 100K k 2048 C18, full-width rounds" timeout 450 python3 bench/step_profile.py --model glm52-scaled \
      --input-len 102400 --concurrency 18 --steps 6 --warmup 3 --presets hisparse,adaptive+spec --drafter oracle \
      --kv-pool-gib 27.82 --host-pool-gib 16 --cuda-graphs step --out "$OUT/step_profile_100k_k2048_c18_h200.json" ;; esac
case ",$STEPS," in *,servewarmup,*)  # dhisparse serve with and without the start-up warm-up, each with an empty Triton cache (~3 min; carry .whl: fastapi, uvicorn, pydantic)
  run "server start-up warm-up" timeout 270 python3 bench/serve_warmup.py --out "$OUT/serve_warmup_h200.json" ;; esac
case ",$STEPS," in *,exactall,*)  # the whole tests/ folder on CUDA, EXACT_N workers (default 12, as session 41 ran it; 10 until session 48: 279 s wall for 2,363 s of tests, the longest file 220 s, since split) (~4 min warm; carry .whl: transformers 5.24, fastapi, uvicorn, pydantic, openai, llguidance, jsonschema)
  run "exactness on CUDA, whole suite" timeout 420 python3 -m pytest -q -p no:cacheprovider -n ${EXACT_N:-12} --dist loadfile tests -rfE \
      --junitxml="$OUT/exact_cuda.xml" ;; esac
case ",$STEPS," in *,fp8kernels,*)  # issue 25: sparse-MLA attention and indexer scoring, FP8 vs bf16 rows (~1.5 min)
  run "FP8 vs bf16 rows in the kernels" timeout 240 python3 bench/fp8_kernels.py --out "$OUT/fp8_kernels_h200.json" ;; esac
case ",$STEPS," in *,fp8test,*)  # issue 25: the FP8 tests on CUDA (~1 min)
  run "FP8 KV tests on CUDA" timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kv_fp8*.py -rfE ;; esac
case ",$STEPS," in *,fp8serving100k,*)  # issue 25: 100K, k 2048, C48, FP8 rows then bf16 rows in one pool (bf16's) and 64 slots (~8 min)
  for KV in ${SERVE_KVS:-fp8_e4m3 auto}; do  # SERVE_KVS: one format per call where a call cannot hold both
    run "serving at 100K, k 2048, C48, --kv-cache-dtype $KV, pool 27.4 GiB" timeout ${SERVE_TIMEOUT:-290} python3 bench/gpu_serving.py \
        --model glm52-scaled --input-len 102400 --output-len 512 --resident-fit 3 --host-pool-gib 24 --concurrency 48 \
        --presets hisparse,adaptive,adaptive+spec --duration 15 --distinct-suffixes 8 --force --kv-cache-dtype $KV \
        --engine-arg kv_pool_bytes=29438263296 --engine-arg max_running_requests=64 \
        --out "$OUT/gpu_serving_100k_k2048_c48_${KV}_h200.json"
  done ;; esac
case ",$STEPS," in *,exactfp8,*)  # issue 25: the CUDA tests of the files the FP8 rows touched (~2.5 min)
  run "exactness on CUDA, FP8-touched files" timeout 200 python3 -m pytest -q -p no:cacheprovider -n 10 --dist loadfile \
      tests/test_kv_fp8*.py tests/test_indexer_kernel.py tests/test_sparse_mla_kernel.py tests/test_hierarchy.py \
      tests/test_engine.py tests/test_prefix_pages.py tests/test_adaptive.py tests/test_spec_engine.py tests/test_v4_hier.py \
      tests/test_v4_engine.py tests/test_step_graphs.py tests/test_graphs.py tests/test_loads.py tests/test_row_place.py \
      -rfE --junitxml="$OUT/exact_cuda_fp8.xml" ;; esac
case ",$STEPS," in *,fp8spec100k,*)  # issue 25: fp8serving100k's adaptive+spec point with FP8 rows, 256-token outputs (~2 min)
  run "serving at 100K, k 2048, C48, FP8 rows, adaptive+spec" timeout 170 python3 bench/gpu_serving.py \
      --model glm52-scaled --input-len 102400 --output-len 256 --resident-fit 3 --host-pool-gib 24 --concurrency 48 \
      --presets adaptive+spec --duration 12 --distinct-suffixes 4 --force --kv-cache-dtype fp8_e4m3 \
      --engine-arg kv_pool_bytes=29438263296 --engine-arg max_running_requests=64 \
      --out "$OUT/gpu_serving_100k_k2048_c48_fp8_spec_h200.json" ;; esac
case ",$STEPS," in *,fp8profile100k,*)  # issue 25: where a 100K k 2048 step goes, FP8 vs bf16 rows, fp8serving100k's pools: C47 (FP8's admitted) and C21 (bf16's) (~5 min)
  for CK in fp8_e4m3:47 fp8_e4m3:21 auto:21; do
    KV=${CK%%:*}; C=${CK##*:}
    run "decode-step profile, 100K k 2048, C$C, --kv-cache-dtype $KV" timeout 200 python3 bench/step_profile.py --model glm52-scaled \
        --input-len 102400 --concurrency $C --steps 5 --warmup 3 --presets hisparse --kv-cache-dtype $KV \
        --kv-pool-gib 27.4166 --host-pool-gib 24 --cuda-graphs step --out "$OUT/step_profile_100k_k2048_c${C}_${KV}_h200.json"
  done ;; esac
case ",$STEPS," in *,prefetch100k,*)  # issue 26 item 2 (+ issue 25's indexer fix): FP8 100K k 2048 C47, follower copies with the producer vs layer-wise on a side stream (~4 min)
  for PF in compute side; do
    run "decode-step profile, 100K k 2048, C47, FP8, --prefetch-stream $PF" timeout 200 python3 bench/step_profile.py --model glm52-scaled \
        --input-len 102400 --concurrency 47 --steps 5 --warmup 3 --presets hisparse --kv-cache-dtype fp8_e4m3 --prefetch-stream $PF \
        --kv-pool-gib 27.4166 --host-pool-gib 24 --cuda-graphs step --out "$OUT/step_profile_100k_k2048_c47_fp8_prefetch_${PF}_h200.json"
  done ;; esac
case ",$STEPS," in *,train29model,*)  # issue 29, call 1: tokenizer + DSA model (bf16 weights) into $OUT/tiny-code (~6 min; carry .whl only: the tree + a cache would pass 64 MiB)
  M=$OUT/tiny-code
  run "train: tokenizer" timeout 120 python3 -m dhisparse.train tokenizer --out "$M"
  run "train: model (dense, indexer warm-up, sparse)" timeout ${TRAIN_MODEL_TIMEOUT:-420} python3 -m dhisparse.train model \
      --tokenizer "$M" --out "$M" --device cuda --batch 32 --seq-len 256 --steps-dense ${STEPS_DENSE:-4000} \
      --steps-warmup ${STEPS_WARMUP:-400} --steps-sparse ${STEPS_SPARSE:-2000} --save-dtype bfloat16
  tar cf "$OUT/tiny-code.tar" -C "$OUT" tiny-code && rm -rf "$M" ;; esac  # one file: the tool returns at most 8
case ",$STEPS," in *,train29draft,*)  # issue 29, call 2: MTP block, DFlash2 drafter, completions + curves for the committed folder $TINY_CODE (~6 min)
  M=$OUT/tiny-code; mkdir -p "$M"; cp -r "${TINY_CODE:?set TINY_CODE to the committed model folder}"/. "$M"/
  run "train: MTP block" timeout 200 python3 -m dhisparse.train mtp --model "$M" --device cuda --steps ${STEPS_MTP:-1500}
  run "train: DFlash2 drafter" timeout 240 python3 -m dhisparse.train drafter --target "$M" --out "$M/dflash2" --device cuda \
      --steps ${STEPS_DRAFTER:-2000}
  run "train: completions and curves" timeout 120 python3 -m dhisparse.train evaluate --model "$M" --device cuda
  tar cf "$OUT/tiny-code.tar" -C "$OUT" tiny-code && rm -rf "$M" ;; esac  # one file: the tool returns at most 8 (s18 lost mtp_record.json so)
case ",$STEPS," in *,exactplain,*)  # the exactness suite with split-row attention and grouped indexer scoring off (~4 min)
  run "exactness on CUDA, no split rows, per-token indexer" timeout 420 env DHISPARSE_MLA_SPLIT_ROWS=0 DHISPARSE_INDEXER_GROUP=0 \
      python3 -m pytest -q -p no:cacheprovider tests/test_hierarchy.py tests/test_adaptive.py tests/test_spec_engine.py \
      tests/test_engine.py tests/test_graphs.py tests/test_step_graphs.py tests/test_loads.py ;; esac
case ",$STEPS," in *,specprofile2,*)  # specprofile's two residency presets alone (~2 min)
  run "decode-step profile, serving pools, C36, adaptive presets" timeout 170 python3 bench/step_profile.py \
      --concurrency 36 --steps 6 --warmup 3 --presets adaptive,adaptive+spec --kv-pool-gib 9.1 \
      --host-pool-gib 32 --cuda-graphs step --out "$OUT/step_profile_serving_c36_adaptive_h200.json" ;; esac
case ",$STEPS," in *,profile4step,*)  # low load at the serving pools, whole-step graphs: resident vs adaptive vs hisparse (~2 min)
  run "decode-step profile, serving pools, C4, step graphs" timeout 200 python3 bench/step_profile.py --concurrency 4 --steps 8 \
      --warmup 3 --presets resident,adaptive,hisparse --kv-pool-gib 9.1 --host-pool-gib 32 --cuda-graphs step \
      --out "$OUT/step_profile_serving_c4_h200.json" ;; esac
case ",$STEPS," in *,serving,*)
  run "serving curves" timeout 420 python3 bench/gpu_serving.py --out "$OUT/gpu_serving_h200.json" ;; esac
case ",$STEPS," in *,serving8k,*)  # the must-show points at 8K: high load C36 and low load C4, four presets (~5 min)
  run "serving at 8K, C36 and C4" timeout 420 python3 bench/gpu_serving.py --concurrency 36,4 --duration 13 --force \
      --out "$OUT/gpu_serving_8k_h200.json" ;; esac
case ",$STEPS," in *,serving8k25,*)  # serving8k with a 25-s window (the 13-s window moves a preset by +-3%) (~7 min)
  run "serving at 8K, C36 and C4, 25-s window" timeout 520 python3 bench/gpu_serving.py --concurrency 36,4 --duration 25 --force \
      --out "$OUT/gpu_serving_8k25_h200.json" ;; esac
case ",$STEPS," in *,serving8kwarm,*)  # serving8k with every step graph captured at engine start (~6 min)
  run "serving at 8K, C36 and C4, step graphs captured at start" timeout 480 python3 bench/gpu_serving.py --concurrency 36,4 \
      --duration 13 --force --engine-arg step_graph_warmup=true --out "$OUT/gpu_serving_8k_warm_h200.json" ;; esac
case ",$STEPS," in *,realdraft,*)  # serving with a real drafter: n-gram lookup (the scaled model's greedy output cycles)
  run "serving, n-gram drafter" timeout 200 python3 bench/gpu_serving.py --concurrency 36,4 --presets hisparse,adaptive+spec \
      --drafter ngram --force --out "$OUT/gpu_serving_ngram_h200.json" ;; esac
case ",$STEPS," in *,budget,*)  # Fig. 9: hot-cache budget B = k, 2k, 4k, 8k (k = 512) at the high load, one file per B
  for B in 512 1024 2048 4096; do
    run "hot-cache budget B=$B" timeout 100 python3 bench/gpu_serving.py --concurrency 36 --presets hisparse,adaptive \
        --hot-cache-rows $B --duration 10 --force --out "$OUT/gpu_budget_B${B}_h200.json"
  done ;; esac
case ",$STEPS," in *,loadstep,*)  # Fig. 6 / Table A1: residency on (adaptive) / off (hisparse), pools as in gpu_serving
  run "load step" timeout 400 python3 -m dhisparse.cli loadstep --model-path glm52-scaled-k512 --device cuda \
      --dtype bfloat16 --page-size 64 --kv-pool-bytes 9730326528 --host-pool-bytes 49715277824 \
      --max-running-requests 65 --max-model-len 8464 --input-len 8192 --output-len 256 --c-low 4 --c-high 48 \
      --low-duration 20 --high-duration 30 --after-duration 30 --no-progress --out "$OUT/loadstep_h200.json" ;; esac
case ",$STEPS," in *,serving32k,*)  # the input size: 32K prompts, 3 resident histories, hierarchy 10x (30 slots)
  run "serving at 32K, C18 (60% of slots) and C2 (every history fits)" timeout 570 python3 bench/gpu_serving.py --input-len 32768 --resident-fit 3 \
      --host-pool-gib 92 --concurrency 18,2 --duration 25 --force --out "$OUT/gpu_serving_32k_h200.json" ;; esac
case ",$STEPS," in *,serving32kc18,*)  # the 32K high-load point alone, without resident (~4 min)
  run "serving at 32K, C18" timeout 330 python3 bench/gpu_serving.py --input-len 32768 --resident-fit 3 \
      --host-pool-gib 92 --concurrency 18 --presets hisparse,adaptive,adaptive+spec --duration 25 --force \
      --out "$OUT/gpu_serving_32k_c18_h200.json" ;; esac
case ",$STEPS," in *,serving32kload,*)  # 32K C18 with admission copies in stream order, then beside the batch (~6 min)
  for L in compute side; do
    run "serving at 32K, C18, load_stream=$L" timeout 280 python3 bench/gpu_serving.py --input-len 32768 --resident-fit 3 \
        --host-pool-gib 92 --concurrency 18 --presets hisparse,adaptive,adaptive+spec --duration 25 --force \
        --engine-arg load_stream=$L --out "$OUT/gpu_serving_32k_c18_load${L}_h200.json"
  done ;; esac
case ",$STEPS," in *,serving32k2k,*)  # 32K C18 with the paper's GLM output cap (2,048 tokens), 100-s windows (~7.5 min)
  run "serving at 32K, C18, 2048-token outputs" timeout 510 python3 bench/gpu_serving.py --input-len 32768 --output-len 2048 \
      --resident-fit 3 --host-pool-gib 92 --concurrency 18 --presets hisparse,adaptive,adaptive+spec --duration 100 \
      --distinct-suffixes 18 --force --out "$OUT/gpu_serving_32k_c18_out2k_h200.json" ;; esac
case ",$STEPS," in *,serving32k2ks,*)  # serving32k2k with 30-s windows: the ramp and steady decode, no second wave (~3.5 min)
  run "serving at 32K, C18, 2048-token outputs, 30-s window" timeout 330 python3 bench/gpu_serving.py --input-len 32768 \
      --output-len 2048 --resident-fit 3 --host-pool-gib 92 --concurrency 18 --presets hisparse,adaptive,adaptive+spec \
      --duration 30 --distinct-suffixes 18 --force --out "$OUT/gpu_serving_32k_c18_out2k30_h200.json" ;; esac
case ",$STEPS," in *,serving32kmid,*)  # the rest of the 32K concurrency sweep
  run "serving at 32K, C27 and C9" timeout 570 python3 bench/gpu_serving.py --input-len 32768 --resident-fit 3 \
      --host-pool-gib 92 --concurrency 27,9 --duration 25 --force --out "$OUT/gpu_serving_32k_mid_h200.json" ;; esac
case ",$STEPS," in *,sweep32khi,*)  # 32K sweep, upper half, 8-GiB host pool (the prefix's pages are shared: 2.9 GB once) (~6 min)
  run "serving at 32K, C27 and C18, four presets" timeout 540 python3 bench/gpu_serving.py --input-len 32768 --resident-fit 3 \
      --host-pool-gib 8 --concurrency 27,18 --duration 25 --force --out "$OUT/gpu_serving_32k_hi_h200.json" ;; esac
case ",$STEPS," in *,sweep32klo,*)  # 32K sweep, lower half: C9 and C2 (every history fits under adaptive) (~6 min)
  run "serving at 32K, C9 and C2, four presets" timeout 540 python3 bench/gpu_serving.py --input-len 32768 --resident-fit 3 \
      --host-pool-gib 8 --concurrency 9,2 --duration 25 --force --out "$OUT/gpu_serving_32k_lo_h200.json" ;; esac
case ",$STEPS," in *,serving100k,*)  # 100K prompts, 3 resident histories, 30 slots: the high-load point C18 (~8 min)
  run "serving at 100K, C18" timeout 560 python3 bench/gpu_serving.py --input-len 102400 --resident-fit 3 \
      --host-pool-gib 16 --concurrency 18 --presets hisparse,adaptive,adaptive+spec --duration 25 --distinct-suffixes 18 --force \
      --out "$OUT/gpu_serving_100k_c18_h200.json" ;; esac
case ",$STEPS," in *,serving100klo,*)  # 100K low load: C2, four presets (~6 min)
  run "serving at 100K, C2" timeout 560 python3 bench/gpu_serving.py --input-len 102400 --resident-fit 3 \
      --host-pool-gib 16 --concurrency 2 --duration 25 --distinct-suffixes 18 --force --out "$OUT/gpu_serving_100k_c2_h200.json" ;; esac
case ",$STEPS," in *,serving100k2k,*)  # 100K C18 with 2,048-token outputs, 30-s window (~4 min)
  run "serving at 100K, C18, 2048-token outputs, 30-s window" timeout 400 python3 bench/gpu_serving.py --input-len 102400 \
      --output-len 2048 --resident-fit 3 --host-pool-gib 16 --concurrency 18 --presets hisparse,adaptive,adaptive+spec \
      --duration 30 --distinct-suffixes 18 --force --out "$OUT/gpu_serving_100k_c18_out2k30_h200.json" ;; esac
case ",$STEPS," in *,serving100kmid,*)  # the rest of a 100K curve: C27 and C9, four presets (~7 min)
  run "serving at 100K, C27 and C9" timeout 480 python3 bench/gpu_serving.py --input-len 102400 --resident-fit 3 \
      --host-pool-gib 16 --concurrency 27,9 --duration 20 --distinct-suffixes 18 --force --out "$OUT/gpu_serving_100k_mid_h200.json" ;; esac
case ",$STEPS," in *,k2048hi,*)  # the paper's GLM setting: k 2,048, B 4,096, 100K, C18, 2,048-token outputs, 30-s window (~5 min)
  run "serving at 100K, k 2048, C18, 2048-token outputs" timeout 330 python3 bench/gpu_serving.py --model glm52-scaled \
      --input-len 102400 --output-len 2048 --resident-fit 3 --host-pool-gib 16 --concurrency 18 \
      --presets hisparse,adaptive,adaptive+spec --duration 30 --distinct-suffixes 18 --force \
      --out "$OUT/gpu_serving_100k_k2048_c18_out2k30_h200.json" ;; esac
case ",$STEPS," in *,k2048curve,*)  # k 2,048, 100K, C18 and C9 with 2,048-token outputs, one oracle reference (~7 min)
  run "serving at 100K, k 2048, C18 and C9, 2048-token outputs" timeout 540 python3 bench/gpu_serving.py --model glm52-scaled \
      --input-len 102400 --output-len 2048 --resident-fit 3 --host-pool-gib 16 --concurrency 18,9 \
      --presets hisparse,adaptive,adaptive+spec --duration 30 --distinct-suffixes 18 --force \
      --out "$OUT/gpu_serving_100k_k2048_out2k30_h200.json" ;; esac
case ",$STEPS," in *,k2048lo,*)  # k 2,048 at low load: C2, where every history fits under adaptive (~3.5 min)
  run "serving at 100K, k 2048, C2" timeout 220 python3 bench/gpu_serving.py --model glm52-scaled --input-len 102400 \
      --resident-fit 3 --host-pool-gib 16 --concurrency 2 --presets hisparse,adaptive,resident --duration 20 \
      --distinct-suffixes 18 --force --out "$OUT/gpu_serving_100k_k2048_c2_h200.json" ;; esac
case ",$STEPS," in *,k2048mid,*)  # k 2,048, C27 and C9, 256-token outputs (~7 min)
  run "serving at 100K, k 2048, C27 and C9" timeout 480 python3 bench/gpu_serving.py --model glm52-scaled \
      --input-len 102400 --resident-fit 3 --host-pool-gib 16 --concurrency 27,9 --presets hisparse,adaptive,adaptive+spec \
      --duration 20 --distinct-suffixes 18 --force --out "$OUT/gpu_serving_100k_k2048_mid_h200.json" ;; esac
case ",$STEPS," in *,costed31,*)  # issue 31 items 2-3a: the costed DFlash2 oracle (the paper's drafter shape: 6 layers at the target's hidden) with speculation charged for its memory (--charge-spec-memory), k 2,048, 100K, C18, 2,048-token outputs, 30-s windows; one tokens-per-round value a call: COSTED_TPR 2.2 / 2.5 / 2.88 (~8 min)
  run "DFlash2 checkpoint (random, paper shape)" python3 bench/drafter_checkpoint.py --model glm52-scaled --kind dflash2 \
      --layers 6 --block 8 --out /tmp/dflash2_6l
  run "costed DFlash2 oracle, charged memory, 100K k 2048 C18, ${COSTED_TPR:-2.88} tokens a round" timeout ${COSTED_TIMEOUT:-480} \
      python3 bench/gpu_serving.py --model glm52-scaled --input-len 102400 --output-len 2048 --resident-fit 3 --host-pool-gib 16 \
      --concurrency 18 --presets "${COSTED_PRESETS:-hisparse,adaptive,adaptive+spec}" --duration 30 --distinct-suffixes 18 --force \
      --charge-spec-memory --spec-width 4 --spec-tokens-per-round ${COSTED_TPR:-2.88} --repeats ${COSTED_REPEATS:-1} \
      --engine-arg speculative_oracle_drafter=dflash2 --engine-arg speculative_draft_model_path=/tmp/dflash2_6l \
      --out "$OUT/costed_dflash2_100k_k2048_c18_tpr${COSTED_TPR:-2.88}_h200.json" ;; esac
case ",$STEPS," in *,backupahead,*)  # the wave boundary's admission trickle: more host backups ahead of reclaim (~2 min)
  run "adaptive, backup ahead 32 vs 128 pages a step" timeout 200 python3 bench/gpu_serving.py --concurrency 36 \
      --presets hisparse,adaptive --duration 13 --force --engine-arg backup_ahead_pages=128 \
      --out "$OUT/gpu_serving_backup128_h200.json" ;; esac
case ",$STEPS," in *,draftercost,*)  # issue 27: a DFlash2 drafter of the paper's shape (6 layers at the target's hidden), glm52-scaled, C18, widths 4 and 8; the first +spec run of each width warms kernels and graphs (~6 min)
  run "DFlash2 checkpoint (random, paper shape)" python3 bench/drafter_checkpoint.py --model glm52-scaled --kind dflash2 \
      --layers 6 --block 8 --out /tmp/dflash2_6l
  for w in 4 8; do
    run "DFlash2 drafter cost, C18, width $w" timeout 200 python3 bench/gpu_serving.py --model glm52-scaled --input-len 8192 \
        --resident-fit 6 --concurrency 18 --presets adaptive+spec,adaptive,adaptive+spec --drafter dflash2 --spec-width $w \
        --duration 15 --engine-arg speculative_draft_model_path=/tmp/dflash2_6l --force \
        --out "$OUT/drafter_cost_dflash2_w${w}_h200.json"
  done ;; esac
case ",$STEPS," in *,retest15,*)  # session 15: the CUDA failures of s15b and the subprocess tests of s15a, again (~1.5 min)
  run "CUDA re-test" timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile tests/test_spec_mtp.py \
      tests/test_topk_ties.py tests/test_v4_resolver_step.py tests/test_cli.py tests/test_readme.py -rfE \
      --junitxml="$OUT/retest_cuda.xml" ;; esac
case ",$STEPS," in *,decodepages,*)  # issue 26 item 4: adaptive with completed decode pages as optional history (ours) vs the paper's hot-cache rule, 8K, C2 and C18 (~3.5 min)
  for mode in optional hot-cache; do
    run "adaptive, --decode-pages $mode, 8K C2 and C18" timeout 150 python3 bench/gpu_serving.py --model glm52-scaled \
        --input-len 8192 --resident-fit 6 --concurrency 2,18 --presets adaptive --duration 15 --force \
        --engine-arg decode_pages=$mode --out "$OUT/decode_pages_${mode}_8k_h200.json"
  done ;; esac
case ",$STEPS," in *,decodepagesrot,*)  # issue 26 item 4's spread: decodepages once more, order rotated by DP_REP (1, 2, 3: one call each, ~3.5 min)
  rep=${DP_REP:-1}; order="optional hot-cache"; [ $((rep % 2)) -eq 0 ] && order="hot-cache optional"
  for mode in $order; do
    run "adaptive, --decode-pages $mode, 8K C2 and C18, run $rep" timeout 150 python3 bench/gpu_serving.py --model glm52-scaled \
        --input-len 8192 --resident-fit 6 --concurrency 2,18 --presets adaptive --duration 15 --force \
        --engine-arg decode_pages=$mode --out "$OUT/decode_pages_${mode}_8k_run${rep}_h200.json"
  done ;; esac
case ",$STEPS," in *,hostfirst27,*)  # issue 26 item 5: --admission-placement import vs auto (host-first under pressure), 32K and 100K at C27, hisparse + adaptive (~8 min; CTX=32768 or 102400 for one context per call)
  for ctx in ${CTX:-32768 102400}; do
    for pl in import auto; do
      run "admission placement $pl, ${ctx} tokens, C27" timeout 280 python3 bench/gpu_serving.py --model glm52-scaled \
          --input-len $ctx --output-len 256 --resident-fit 3 --host-pool-gib 48 --concurrency 27 --presets hisparse,adaptive \
          --duration 15 --distinct-suffixes 8 --force --kv-cache-dtype fp8_e4m3 --engine-arg admission_placement=$pl \
          --out "$OUT/gpu_serving_${ctx}_c27_placement_${pl}_h200.json"
    done
  done ;; esac
case ",$STEPS," in *,mtptest,*)  # the MTP drafter files on CUDA (~1 min)
  run "MTP on CUDA" timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 --dist loadfile tests/test_spec_mtp*.py \
      tests/test_drafters_models.py tests/test_adaptive.py -rfE --junitxml="$OUT/mtp_cuda.xml" ;; esac
case ",$STEPS," in *,train29drafter,*)  # issue 29: the DFlash2 drafter of the committed tiny-code into its dflash2/ folder, packed as one file (~3.5 min)
  M=dhisparse/models/builtin/tiny-code
  run "train: DFlash2 drafter" timeout 260 python3 -m dhisparse.train drafter --target "$M" --out "$M/dflash2" --device cuda \
      --steps ${STEPS_DRAFTER:-2000}
  tar cf "$OUT/dflash2.tar" -C "$M" dflash2 ;; esac  # one file: the tool returns at most 8
case ",$STEPS," in *,tinyspec,*)  # issue 29: tokens per round and speedup of mtp / dflash2 / ngram at width 4 on tiny-code, 3 presets (~3 min)
  run "tiny-code drafters through the engine" timeout ${TINYSPEC_TIMEOUT:-200} python3 bench/tiny_code_spec.py --device cuda \
      --out "$OUT/tiny_code_spec_h200.json" ;; esac
case ",$STEPS," in *,exactint,*|*,exactfiles,*)  # exactall under a deadline: SIGINT at EXACT_S seconds still writes the JUnit file of what ran;
  # EXACT_FILES (space-separated pytest arguments, e.g. '--dist load tests/test_a.py') narrows it (step exactfiles: the same step)
  run "exactness on CUDA, ${EXACT_FILES:-whole suite}, ${EXACT_S:-300}-s deadline" timeout -s INT ${EXACT_S:-300} python3 -m pytest -q -p no:cacheprovider \
      -n ${EXACT_N:-10} --dist loadfile ${EXACT_FILES:-tests} -rfE --junitxml="$OUT/exact_cuda.xml" ;; esac
case ",$STEPS," in *,world1,*)  # issue 30: world size 1 through the Coordinator vs the plain engine, one engine, arms alternated (~3 min cold)
  run "world size 1: Coordinator vs Engine, 2K C8" timeout ${WORLD1_TIMEOUT:-200} python3 bench/world1_overhead.py --device cuda \
      --model glm52-scaled --input-len 2048 --concurrency 8 --max-tokens 64 --repeats 3 \
      --engine-arg kv_pool_bytes=8589934592 --engine-arg host_pool_bytes=8589934592 --out "$OUT/world1_overhead_h200.json" ;; esac
case ",$STEPS," in *,staging26,*)  # issue 26 item 1: verification staging paper (chi arenas + promotion) vs single, adaptive+spec, 8K C18,
  # both arms in one process (the model and oracle reference built once), STAGING_REPEATS rounds, the arm order
  # rotated every round (s19: two 120-s processes never reached a window); each run is written as it ends
  run "adaptive+spec, --staging-mode paper vs single, 8K C18, ${STAGING_REPEATS:-3} rounds" timeout ${STAGING_TIMEOUT:-250} \
      python3 bench/gpu_serving.py --model glm52-scaled --input-len 8192 --resident-fit 6 --host-pool-gib 32 --concurrency 18 \
      --presets adaptive+spec --duration 12 --force --spec-width 4 --spec-tokens-per-round 2.88 \
      --arms "${STAGING_ARMS:-staging_mode=paper;staging_mode=single}" --repeats ${STAGING_REPEATS:-3} \
      --out "$OUT/staging_8k_c18_h200.json" ;; esac
case ",$STEPS," in *,fp8w31,*)  # issue 31 item 1: CUDA exactness of the FP8 weight GEMMs and the glm5-faithful model; their bandwidth against bf16 torch.matmul (~2 min)
  run "exactness on CUDA, FP8 weights" timeout ${FP8W_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
      tests/test_fp8_gemm.py tests/test_fp8_modules.py tests/test_faithful_model.py tests/test_moe.py tests/test_sparse_mla_kernel.py --junitxml="$OUT/fp8w31_cuda.xml"
  run "FP8 weight GEMMs vs bf16 matmul" timeout ${FP8B_TIMEOUT:-200} python3 bench/fp8_gemm_bench.py --out "$OUT/fp8_gemm_bench_h200.json" ;; esac
case ",$STEPS," in *,faithful31,*)  # issue 31 item 1: where a glm5-faithful 100K decode step goes (the expert GEMMs' share), hisparse C${FAITHFUL_C:-47}, FP8 rows (~5 min); FAITHFUL_PRESETS=hisparse,adaptive+spec adds a full-width verification round (placeholder oracle)
  run "decode-step profile, glm5-faithful, 100K k 2048, C${FAITHFUL_C:-47}, fp8" timeout ${FAITHFUL_TIMEOUT:-420} python3 bench/step_profile.py \
      --model glm5-faithful --input-len 102400 --concurrency ${FAITHFUL_C:-47} --steps 5 --warmup 3 --presets ${FAITHFUL_PRESETS:-hisparse} \
      --kv-cache-dtype fp8_e4m3 --kv-pool-gib 27.4166 --host-pool-gib 24 --max-batched-tokens 8192 --cuda-graphs step --drafter oracle \
      --out "$OUT/step_profile_faithful_100k_k2048_c${FAITHFUL_C:-47}_fp8_e4m3_h200.json" ;; esac
case ",$STEPS," in *,round31,*)  # issue 31: where a costed verification round goes at the costed sweep's point (glm5-faithful, 100K, k 2,048, FP8 rows, C${ROUND31_C:-20}): hisparse's decode step beside adaptive+spec's full-width round (placeholder oracle: every draft rejected) with the paper-shaped DFlash2 network running in it (the costed oracle), kernels and host split per step (~6 min); ROUND31_ARGS adds step_profile arguments (e.g. "--engine-arg indexer_topk=lean"), ROUND31_TAG a file-name suffix
  run "DFlash2 checkpoint (random, paper shape, hidden 6144)" python3 bench/drafter_checkpoint.py --model glm5-faithful --kind dflash2 \
      --layers 6 --block 8 --shape paper-glm5 --out /tmp/dflash2_6l_faithful
  run "step profile, glm5-faithful, hisparse step vs costed DFlash2 round, C${ROUND31_C:-20}" timeout ${ROUND31_TIMEOUT:-480} python3 bench/step_profile.py \
      --model glm5-faithful --input-len 102400 --concurrency ${ROUND31_C:-20} --steps 5 --warmup 3 --top ${ROUND_TOP:-80} --presets hisparse,adaptive+spec \
      --kv-cache-dtype fp8_e4m3 --kv-pool-gib 15.6 --host-pool-gib 16 --max-batched-tokens 8192 --cuda-graphs step --drafter oracle \
      --engine-arg speculative_oracle_drafter=dflash2 --engine-arg speculative_draft_model_path=/tmp/dflash2_6l_faithful ${ROUND31_ARGS:-} \
      --out "$OUT/step_profile_round_faithful_100k_k2048_c${ROUND31_C:-20}${ROUND31_TAG:-}_fp8_e4m3_h200.json" ;; esac
case ",$STEPS," in *,round44,*)  # issue 31 on an H100 (no H200 lent): round31's profile on glm5-faithful with 12 routed experts (51.9 GiB of FP8 weights; the full 24 take 83.5 GiB, an H200), pool ${ROUND44_POOL:-9.5} GiB, prefill chunks of ${ROUND44_MBT:-2048} (8,192 ran out of memory in session 44), C${ROUND44_C:-20} at 100K, hisparse's decode step beside the costed DFlash2 round, under each --fp8-activations of ROUND44_ACTS (default "auto none": w8a8, the default since session 44, then w8a16; ~6 min each cold, so one a call: ROUND44_ACTS=none in the second); ROUND44_PRESETS (default hisparse,adaptive+spec) and ROUND44_TAG (a file-name suffix) for a round alone
  run "DFlash2 checkpoint (random, paper shape, hidden 6144)" python3 bench/drafter_checkpoint.py --model glm5-faithful --kind dflash2 \
      --layers 6 --block 8 --shape paper-glm5 --out /tmp/dflash2_6l_faithful
  for A in ${ROUND44_ACTS:-auto none}; do
    run "step profile, glm5-faithful e12, hisparse step vs costed DFlash2 round, C${ROUND44_C:-20}, fp8_activations=$A" timeout ${ROUND44_TIMEOUT:-480} \
        python3 bench/step_profile.py --model glm5-faithful --overrides '{"n_routed_experts": 12}' --input-len 102400 \
        --concurrency ${ROUND44_C:-20} --steps 5 --warmup 3 --top ${ROUND_TOP:-80} --presets ${ROUND44_PRESETS:-hisparse,adaptive+spec} --kv-cache-dtype fp8_e4m3 \
        --kv-pool-gib ${ROUND44_POOL:-9.5} --host-pool-gib 16 --max-batched-tokens ${ROUND44_MBT:-2048} --cuda-graphs step --drafter oracle \
        --engine-arg speculative_oracle_drafter=dflash2 --engine-arg speculative_draft_model_path=/tmp/dflash2_6l_faithful \
        --engine-arg fp8_activations=$A --out "$OUT/step_profile_round_faithful_e12_100k_k2048_c${ROUND44_C:-20}_${A}${ROUND44_TAG:-}_fp8_e4m3_h200.json"
  done ;; esac
case ",$STEPS," in *,topk31,*)  # issue 31: the indexer's tie-ruled top-k, stable_topk (two top-k passes and two sorts, the baseline) vs packed_topk (one top-k over int64 keys) and lean_topk (one sort), at 100K, k 2,048, rows 20 / 47 / 100 (~1 min)
  run "indexer top-k: stable, packed, lean" timeout ${TOPK31_TIMEOUT:-150} python3 bench/topk_bench.py --out "$OUT/topk_bench_h200.json" ;; esac
case ",$STEPS," in *,indexer46,*)  # issue 31: the indexer's scoring launch (block_s, warps, per-token-in-group vs one-product grouped kernel) at glm5-faithful's shape, 100K keys, decode C20 and an 18 x 5 round, with bitwise round == decode checks (~2 min cold)
  run "indexer scoring configurations" timeout ${INDEXER46_TIMEOUT:-240} python3 bench/indexer_tune_bench.py --out "$OUT/indexer_tune_h200.json" ;; esac
case ",$STEPS," in *,dflashattn46,*)  # issue 31: the DFlash drafter's fused 16-bit attention (session 46): CUDA exactness of the drafter files, then one layer of the paper's DFlash2 shape at C20 / C47, fused against the upcast form (~1.5 min)
  run "exactness on CUDA, drafter files" timeout ${EXACT46_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/test_dflash_attention.py tests/test_dflash_graphs.py tests/test_spec_dflash.py tests/test_drafters_models.py \
      tests/test_costed_oracle.py tests/test_dflash_reference.py -rfE --junitxml="$OUT/exact_cuda_drafter.xml"
  run "DFlash attention, fused vs upcast" timeout 60 python3 bench/dflash_attention_bench.py --out "$OUT/dflash_attention_h200.json" ;; esac
case ",$STEPS," in *,moealign46,*)  # issue 31: a MoE layer's row grouping, the one-program kernel (kernels/moe_align.py, session 46) against the torch form, at decode and round sizes, E 12 / 24 / 256, CUDA-graph replays, then its CUDA exactness with the FP8 MoE files (~1.5 min)
  run "MoE row grouping, kernel vs torch" timeout 90 python3 bench/moe_align_bench.py --out "$OUT/moe_align_h200.json"
  run "exactness on CUDA, MoE grouping files" timeout ${EXACT46M_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -n 4 --dist loadfile \
      tests/test_moe_align.py tests/test_fp8_gemm.py tests/test_fp8_w8a8.py -rfE --junitxml="$OUT/exact_cuda_moe_align.xml" ;; esac
case ",$STEPS," in *,mlasplit47,*)  # issue 31: the sparse-MLA split (rows a program walks; 128 from session 10 at 16 heads; the wide tile's 512 since session 48) at glm5-faithful's tile (64 heads, k 2,048, FP8 rows) over decode and round pass sizes, then bench/mla_split_pick.py's rule (geometric mean over T below 0.97x of the default) and, with MLASPLIT47_APPLY=1, that split patched in as WIDE_SPLIT_ROWS of this call's tree (for an exactall after it in the same call; ~1.5 min)
  run "sparse-MLA split sweep, 64 heads, k 2048, FP8 rows" timeout ${MLASPLIT47_TIMEOUT:-240} python3 bench/mla_tune_bench.py --heads 64 --topk 2048 \
      --kv-cache-dtype fp8_e4m3 --tokens ${MLASPLIT47_TOKENS:-20,47,90,235} --block-h 64 --splits ${MLASPLIT47_SPLITS:-256,512,1024,0} --block-k 64 \
      --warps 8 --stages 1 --out "$OUT/mla_split_h200.json"
  N=$(python3 bench/mla_split_pick.py "$OUT/mla_split_h200.json" 2>>"$LOG"); echo "split picked: $N" | tee "$OUT/mla_split_pick.txt"
  if [ -n "${MLASPLIT47_APPLY:-}" ] && [ -n "$N" ]; then
    sed -i "s/^WIDE_SPLIT_ROWS = [0-9]*/WIDE_SPLIT_ROWS = $N/" dhisparse/kernels/backend.py
    grep -n '^WIDE_SPLIT_ROWS' dhisparse/kernels/backend.py | tee -a "$OUT/mla_split_pick.txt"
  fi ;; esac
case ",$STEPS," in *,copyorder33,*)  # issue 33: the resolver's copy in host-address order against selection order, pages scattered over a ${COPYORDER33_GIB:-16}-GiB pinned region (~1.5 min)
  run "copy order" timeout ${COPYORDER33_TIMEOUT:-200} python3 bench/copy_order.py --region-gib ${COPYORDER33_GIB:-16} \
      --out "$OUT/copy_order_h200.json" ;; esac
case ",$STEPS," in *,settle31,*)  # issue 31: does glm5-faithful's 100K greedy output stay varied over 1,024 tokens (session 39's byte-head reference settled on one token after 128-500, refused by the guard; session 40 made the head score every id, which stopped a small CPU build's 4-token cycle over 16K)? The costed sweep's shape (100K, FP8 rows, 1,024 tokens), 3 prompts, the logprob margins and the cycle share, for each head in ${SETTLE31_HEADS:-full byte} (models/faithful.py full_vocab_head: full is the build's default, byte the build before) and frequency penalty ${SETTLE31_FP:-0} (~3 min a variant; the full build needs an H200; on an H100: SETTLE31_OVERRIDES='{"n_routed_experts": 12}' SETTLE31_PROMPTS=2 SETTLE31_POOL=14, since 100K of FP8 rows over 78 layers is 5.9 GiB a prompt and the 12-expert build ~52 GiB)
  for HV in ${SETTLE31_HEADS:-full byte}; do
    run "settling at 100K, head $HV" timeout ${SETTLE31_TIMEOUT:-280} python3 bench/faithful_diversity.py --model glm5-faithful \
        --device cuda --prompts ${SETTLE31_PROMPTS:-3} --prompt-len 102400 --tokens 1024 --kv-cache-dtype fp8_e4m3 --kv-pool-gib ${SETTLE31_POOL:-24} \
        --margins --head-vocab $HV --frequency-penalty ${SETTLE31_FP:-0} ${SETTLE31_OVERRIDES:+--overrides "$SETTLE31_OVERRIDES"} \
        --out "$OUT/settle_glm5_faithful_${HV}_fp${SETTLE31_FP:-0}_h200.json"
  done ;; esac
case ",$STEPS," in *,settle41,*)  # issue 31: does v41-faithful's greedy output stay varied (glm5-faithful's byte head settled on one token at 100K after 128-500 tokens, session 39) before Fig. 5's references are decoded from it? ${SETTLE41_LEN:-131072} tokens of context (one of fig5v41's), ${SETTLE41_TOKENS:-512} tokens (Fig. 5's outputs are 256), 3 prompts, FP8 rows, the margins, for each head in ${SETTLE41_HEADS:-full} (~3 min a head; 57 GiB: fits an H100)
  for HV in ${SETTLE41_HEADS:-full}; do
    run "settling, v41-faithful, ${SETTLE41_LEN:-131072}, head $HV" timeout ${SETTLE41_TIMEOUT:-280} python3 bench/faithful_diversity.py \
        --model v41-faithful --device cuda --prompts 3 --prompt-len ${SETTLE41_LEN:-131072} --tokens ${SETTLE41_TOKENS:-512} \
        --kv-cache-dtype fp8_e4m3 --kv-pool-gib ${SETTLE41_POOL:-8} --margins --head-vocab $HV \
        --out "$OUT/settle_v41_faithful_${SETTLE41_LEN:-131072}_${HV}_h200.json"
  done ;; esac
case ",$STEPS," in *,diversity31,*)  # issue 31: before any oracle reference is decoded from them, do the faithful models' greedy outputs depend on their context (sessions 36-37: glm5-faithful's 100K reference was one token repeated)? ${DIVERSITY31_MODELS:-glm5-faithful}, full geometry, 4 prompts of 4K, 64 tokens each, and the final states' common share (~1 min a model)
  for M in ${DIVERSITY31_MODELS:-glm5-faithful}; do
    run "greedy diversity, $M" timeout ${DIVERSITY31_TIMEOUT:-200} python3 bench/faithful_diversity.py --model $M --device cuda \
        --prompts 4 --prompt-len 4096 --tokens 64 --out "$OUT/faithful_diversity_${M}_h200.json"
  done ;; esac
case ",$STEPS," in *,locality31,*)  # issue 31: glm5-faithful's selection locality at its full geometry in bf16 where it is served: hisparse, one request over a ${LOCALITY31_LEN:-102400}-token history, B = ${LOCALITY31_HOT:-2}k, embedding offset ${LOCALITY31_OFFSET:-4.5}, index gains ${LOCALITY31_GAINS:-12} (models/faithful.py's calibration, session 43: 13.9% host-fetched; the paper 14.2%), one process a gain (a second full-size build in one process ran out of memory) (~1.5 min a gain); on an H100: LOCALITY31_OVERRIDES='{"n_routed_experts": 12}' (session 43's calibration ran so); session 38's 8K calibration: LOCALITY31_LEN=8192 LOCALITY31_POOL=4 LOCALITY31_HOT=1,2
  for G in $(echo ${LOCALITY31_GAINS:-12} | tr , ' '); do
    run "selection locality, glm5-faithful, bf16, gain $G" timeout ${LOCALITY31_TIMEOUT:-200} python3 bench/locality.py --model glm5-faithful --layers 78 --device cuda \
        --dtype bfloat16 --prompt-len ${LOCALITY31_LEN:-102400} --kv-pool-gib ${LOCALITY31_POOL:-16} --offsets ${LOCALITY31_OFFSET:-4.5} --gains $G --hot ${LOCALITY31_HOT:-2} ${LOCALITY31_OVERRIDES:+--overrides "$LOCALITY31_OVERRIDES"} \
        --out "$OUT/locality_glm5_faithful_g${G}_h200.json"
  done ;; esac
case ",$STEPS," in *,faithful41,*)  # issue 31 item 5: where a v41-faithful decode step goes (the experts' share against the paper's 53%), hisparse, FP8 rows, ${FAITHFUL41_LEN:-131072} tokens, C${FAITHFUL41_C:-16} (untried: the model builds ~57 GiB layer by layer)
  run "decode-step profile, v41-faithful, ${FAITHFUL41_LEN:-131072}, C${FAITHFUL41_C:-16}, fp8" timeout ${FAITHFUL41_TIMEOUT:-420} python3 bench/step_profile.py \
      --model v41-faithful --input-len ${FAITHFUL41_LEN:-131072} --concurrency ${FAITHFUL41_C:-16} --steps 5 --warmup 3 --presets ${FAITHFUL41_PRESETS:-hisparse} \
      --kv-cache-dtype fp8_e4m3 --kv-pool-gib ${FAITHFUL41_POOL_GIB:-24} --host-pool-gib ${FAITHFUL41_HOST_GIB:-32} --max-batched-tokens 8192 --cuda-graphs step \
      --out "$OUT/step_profile_v41_faithful_${FAITHFUL41_LEN:-131072}_c${FAITHFUL41_C:-16}_fp8_e4m3_h200.json" ;; esac
case ",$STEPS," in *,mla64,*)  # issue 31: sparse-MLA launch configurations at glm5-faithful's shape (64 heads, k 2,048, FP8 rows), decode C47 and its width-4 verification (~6 min cold)
  run "sparse-MLA configurations, 64 heads, FP8 rows" timeout ${MLA64_TIMEOUT:-330} python3 bench/mla_tune_bench.py --heads 64 --topk 2048 \
      --kv-cache-dtype fp8_e4m3 --tokens 47,188 --block-h 16,32,64 --splits 128 --block-k 16,32,64 --warps 8,16 --stages 1,2 \
      --out "$OUT/mla_tune_64h_fp8_h200.json"
  run "sparse-MLA fold scale path, 64 heads" timeout ${MLA64F_TIMEOUT:-150} python3 bench/mla_tune_bench.py --heads 64 --topk 2048 \
      --kv-cache-dtype fp8_e4m3 --tokens 47,188 --block-h 32,64 --splits 128 --block-k 32 --warps 8,16 --stages 2 --scales fold \
      --out "$OUT/mla_tune_64h_fp8_fold_h200.json" ;; esac
case ",$STEPS," in *,costedfaithful31,*)  # issue 31: the costed DFlash2 oracle on glm5-faithful (drafter of the paper's shape: 6 layers at hidden 6,144, 4 K/V heads: 12,288 B a ring row and 4.84 GiB, as the paper's 12,288 B and 4.9 GiB; s30's first run had the target's 64 K/V heads, 12x the ring), charged memory, FP8 rows, 100K k 2,048, C${COSTED_FAITHFUL_C:-20} (60% of the 33 slots that --resident-fit 3 gives with FP8 rows: the high-load point); one tokens-per-round value a call. Budget (s30, 533c048): model 7 s, 100K prefix ~90 s, oracle reference ~100 s (1,024 greedy steps at C20), hisparse's window 48 s, adaptive+spec's over 150 s; the reference comes back as $OUT/oracle_reference_faithful.json: carry it and pass COSTED_REF=<its absolute path> to a later call on the same package files to skip its decode (docs, tests and bench/ commits keep it; a file made by other dhisparse/ files is refused: dhisparse/bench/reference.py code_digest)
  run "DFlash2 checkpoint (random, paper shape, hidden 6144)" python3 bench/drafter_checkpoint.py --model glm5-faithful --kind dflash2 \
      --layers 6 --block 8 --shape paper-glm5 --out /tmp/dflash2_6l_faithful
  run "costed DFlash2 oracle on glm5-faithful, ${COSTED_TPR:-2.88} tokens a round" timeout ${COSTED_TIMEOUT:-480} \
      python3 bench/gpu_serving.py --model glm5-faithful --input-len 102400 --output-len ${COSTED_OUT:-1024} --resident-fit 3 --host-pool-gib 16 \
      --kv-cache-dtype fp8_e4m3 --max-batched-tokens 8192 --concurrency ${COSTED_FAITHFUL_C:-20} --presets "${COSTED_PRESETS:-hisparse,adaptive,adaptive+spec}" \
      --duration 30 --stagger --distinct-suffixes ${COSTED_FAITHFUL_C:-20} --force --charge-spec-memory --spec-width 4 --spec-tokens-per-round ${COSTED_TPR:-2.88} \
      --repeats ${COSTED_REPEATS:-1} --engine-arg speculative_oracle_drafter=dflash2 --engine-arg speculative_draft_model_path=/tmp/dflash2_6l_faithful \
      --reference-file "${COSTED_REF:-$OUT/oracle_reference_faithful.json}" \
      --out "$OUT/costed_dflash2_faithful_100k_k2048_c${COSTED_FAITHFUL_C:-20}_tpr${COSTED_TPR:-2.88}_h200.json" ;; esac
case ",$STEPS," in *,costedsweep31,*|*,costedsweep48,*)  # issue 31: costedfaithful31's run with hisparse once and adaptive+spec at each of
  # costedsweep48: the same on an H100 (no H200 lent since session 42): glm5-faithful with 12 routed experts (51.9 GiB
  # of FP8 weights, round44's build), the H200's pool (--resident-fit 3: 15.6 GiB, 30 slots; 21 when the drafter is
  # charged), prefill chunks of 2,048 (8,192 ran out of memory in session 44), C18 (60% of 30: the high-load point),
  # one arm a call (COSTED_TPRS, default 2.88), files suffixed _e12. Should it not fit: COSTED_FIT=2
  # COSTED_FAITHFUL_C=12 (10.4 GiB, 20 slots; the drafter then leaves ~10)
  if [[ ",$STEPS," == *,costedsweep48,* ]]; then
    CS_EXTRA='--overrides {"n_routed_experts":12}'; CS_C=${COSTED_FAITHFUL_C:-18}; CS_TPRS=${COSTED_TPRS:-2.88}
    CS_MBT=${COSTED_MBT:-2048}; CS_TAG=_e12
  else
    CS_EXTRA=""; CS_C=${COSTED_FAITHFUL_C:-20}; CS_TPRS=${COSTED_TPRS:-2.2 2.88}; CS_MBT=${COSTED_MBT:-8192}; CS_TAG=""
  fi
  # (every preset replays the reference, --replay-reference: s42's unreplayed run left it, 94.7% of proposals off, 1.08
  # tokens a round set to 2.88; COSTED_NO_REPLAY=" " turns it off)
  # COSTED_TPRS (default 2.2 and 2.88 tokens a round; 2.5 in a second call) as arms of one process: the ratios side by side in
  # one run against one shared hisparse window (gpu_serving --arm-presets). Carry the reference (COSTED_REF) to stay in one call.
  run "DFlash2 checkpoint (random, paper shape, hidden 6144)" python3 bench/drafter_checkpoint.py --model glm5-faithful --kind dflash2 \
      --layers 6 --block 8 --shape paper-glm5 --out /tmp/dflash2_6l_faithful
  ARMS=""; for T in $CS_TPRS; do ARMS="$ARMS;speculative_oracle_tokens_per_round=$T"; done
  run "costed DFlash2 oracle on glm5-faithful$CS_TAG, arms $CS_TPRS tokens a round" timeout ${COSTED_TIMEOUT:-540} \
      python3 bench/gpu_serving.py --model glm5-faithful $CS_EXTRA --input-len 102400 --output-len ${COSTED_OUT:-1024} --resident-fit ${COSTED_FIT:-3} --host-pool-gib 16 \
      --kv-cache-dtype fp8_e4m3 --max-batched-tokens $CS_MBT --concurrency $CS_C --presets hisparse,adaptive+spec \
      --arms "${ARMS#;}" --arm-presets adaptive+spec --repeats ${COSTED_REPEATS:-1} --rotate ${COSTED_ROTATE:-0} \
      --duration 30 --stagger --distinct-suffixes $CS_C --force --charge-spec-memory --spec-width 4 \
      --engine-arg speculative_oracle_drafter=dflash2 --engine-arg speculative_draft_model_path=/tmp/dflash2_6l_faithful \
      --reference-file "${COSTED_REF:-$OUT/oracle_reference_faithful$CS_TAG.json}" ${COSTED_NO_REPLAY:---replay-reference} \
      --out "$OUT/costed_sweep_faithful${CS_TAG}_100k_k2048_c${CS_C}_h200.json" ;; esac
small_card() {  # true on a card under 100 GB (an H100), or where nvidia-smi answers nothing (the CPU tests)
  local gb; gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  [ "${gb:-0}" -lt 100000 ]
}
faithful_build() {  # the glm5-faithful build a card holds: the full one from 100 GiB, else 12 routed experts (an H100 stand-in, files _e12)
  if small_card; then FB_EXTRA='--overrides {"n_routed_experts":12}'; FB_TAG=_e12; FB_MBT=2048
  else FB_EXTRA=""; FB_TAG=""; FB_MBT=8192; fi
  # gpu_serving's arguments for it in the costed sweep's pool (three resident 100K histories, FP8 rows), and
  # those at the sweep's 100K in / 1,024 out
  FB_POOL="--resident-fit 3 --host-pool-gib 16 --kv-cache-dtype fp8_e4m3 --max-batched-tokens $FB_MBT"
  FB_100K="--model glm5-faithful $FB_EXTRA --input-len 102400 --output-len 1024 $FB_POOL"
}
case ",$STEPS," in *,budget31,*)  # issue 31's Fig. 9 at the paper's setting: glm5-faithful at 100K, k 2,048, FP8 rows, the costed sweep's pool, hot-cache budget B = BUDGET31_B (one a call: 2048 4096 8192 16384, k ... 8k) at low and high load (C2, C18), hisparse and adaptive: output and host-fetched share; `dhisparse plot` draws budget.png from the four files (~5 min a B)
  faithful_build
  run "Fig. 9, glm5-faithful$FB_TAG, B ${BUDGET31_B:-4096}, C${BUDGET31_C:-2,18}" timeout ${BUDGET31_TIMEOUT:-570} \
      python3 bench/gpu_serving.py $FB_100K --concurrency ${BUDGET31_C:-2,18} \
      --presets hisparse,adaptive --hot-cache-rows ${BUDGET31_B:-4096} --duration 30 --stagger --distinct-suffixes 18 --force \
      --out "$OUT/budget_faithful${FB_TAG}_100k_k2048_B${BUDGET31_B:-4096}_h200.json" ;; esac
case ",$STEPS," in *,widths31,*)  # issue 31's Fig. 7 at the paper's setting: adaptive+spec on glm5-faithful at 100K with the costed DFlash2 oracle and speculation charged, fixed widths 4 / 6 / 8 and eq. 13's online policy (K_max 8) as arms of one process at one load a call (WIDTHS31_C: 2, 9 or 18), acceptance calibrated to 2.88 tokens a round at width 4 (as specpolicy); the arms a call runs: WIDTHS31_ORDER (default all four; two calls a load fit: "online:8 fixed:4", then "fixed:6 fixed:8" with COSTED_REF carrying the first call's reference); every preset replays the reference (~9 min for two arms with the reference decode)
  faithful_build
  run "DFlash2 checkpoint (random, paper shape, hidden 6144)" python3 bench/drafter_checkpoint.py --model glm5-faithful --kind dflash2 \
      --layers 6 --block 8 --shape paper-glm5 --out /tmp/dflash2_6l_faithful
  tpr() { python3 -c "import dhisparse.spec.oracle as o; c = o.corrupt_rate_for_tokens_per_round(2.88, 4); print(round(o.expected_tokens_per_round(1 - c, $1), 4))"; }
  W_ARMS=""; for POL in ${WIDTHS31_ORDER:-online:8 fixed:4 fixed:6 fixed:8}; do
    W_ARMS="$W_ARMS;speculative_policy=${POL%%:*},speculative_num_draft_tokens=${POL##*:},speculative_oracle_tokens_per_round=$(tpr ${POL##*:})"
  done
  run "Fig. 7, glm5-faithful$FB_TAG, widths at C${WIDTHS31_C:-9}" timeout ${WIDTHS31_TIMEOUT:-570} \
      python3 bench/gpu_serving.py $FB_100K --concurrency ${WIDTHS31_C:-9} \
      --presets adaptive+spec --arms "${W_ARMS#;}" --spec-width 8 --charge-spec-memory --duration 30 --stagger \
      --distinct-suffixes ${WIDTHS31_C:-9} --force --engine-arg speculative_oracle_drafter=dflash2 \
      --engine-arg speculative_draft_model_path=/tmp/dflash2_6l_faithful --replay-reference \
      --reference-file "${COSTED_REF:-$OUT/oracle_reference_faithful${FB_TAG}_c${WIDTHS31_C:-9}.json}" \
      --out "$OUT/widths_faithful${FB_TAG}_100k_k2048_c${WIDTHS31_C:-9}_h200.json" ;; esac
case ",$STEPS," in *,stage49,*)  # issue 31: a round's overflow staging in one launch (kernels/stage_overflow.py; the default since session 50, when this ran: 185 tests, 3.3-5.5x the torch form's speed): the staging, spec, graph and hierarchy files on CUDA with the kernel on, then the kernel against the torch form at glm5-faithful's round shape in CUDA graphs (~4 min cold); `ROUND44_ACTS=auto round44` times the round with it, `DHISPARSE_STAGE_KERNEL=0 ROUND44_ACTS=auto ROUND44_TAG=_torchstage round44` without it (one call each)
  run "exactness on CUDA, staging through the kernel" env DHISPARSE_STAGE_KERNEL=1 timeout ${STAGE49_TIMEOUT:-330} \
      python3 -m pytest -q -p no:cacheprovider -n ${EXACT_N:-12} --dist loadfile tests/test_stage_overflow_kernel.py \
      tests/test_staging_dedup.py tests/test_staging_paper.py tests/test_spec_engine.py tests/test_v4_resolver_step.py \
      tests/test_step_graphs.py tests/test_graphs.py tests/test_hierarchy.py tests/test_request_isolation.py \
      tests/test_resolver_hot_entry.py tests/test_v4_sources.py tests/test_v4_prefix.py tests/test_prefetch.py \
      -rfE --junitxml="$OUT/exact_cuda_stage.xml"
  run "overflow staging, kernel vs torch" timeout 150 python3 bench/stage_overflow_bench.py --out "$OUT/stage_overflow_h200.json" ;; esac
case ",$STEPS," in *,lowload31,*)  # issue 31's low-load point: adaptive / resident >= 0.98x and the host-fetched share with residency on (adaptive) vs off (hisparse) >= 10x lower; glm5-faithful at 100K, k 2,048, FP8 rows, the costed sweep's pool (3 resident histories), C${LOWLOAD_C:-2}, one repeat a call with the preset order rotated by LOWLOAD_ROTATE (0, 1, 2: three calls); on a card under 100 GiB the 12-expert build (an H100 stand-in, files _e12) (~4 min)
  faithful_build
  run "low load, glm5-faithful$FB_TAG, C${LOWLOAD_C:-2}, rotation ${LOWLOAD_ROTATE:-0}" timeout ${LOWLOAD_TIMEOUT:-540} \
      python3 bench/gpu_serving.py $FB_100K --concurrency ${LOWLOAD_C:-2} \
      --presets resident,adaptive,hisparse --repeats 1 --rotate ${LOWLOAD_ROTATE:-0} --duration 30 --stagger \
      --distinct-suffixes ${LOWLOAD_C:-2} --force --out "$OUT/lowload_faithful${FB_TAG}_100k_k2048_c${LOWLOAD_C:-2}_r${LOWLOAD_ROTATE:-0}_h200.json" ;; esac
case ",$STEPS," in *,fig4_31,*)  # issue 31's Fig. 4 / Table 2 at the paper's setting: all five presets side by side at one load a call (FIG4_C: 2, 9, 18, 30 = the slot-bound point) on glm5-faithful at FIG4_IN (102400) in / FIG4_OUT (1024) out, k 2,048, FP8 rows, the costed sweep's pool (three resident 100K histories; FIG4_POOL GiB instead), +spec presets with the costed DFlash2 oracle at 2.88 tokens a round and charged for their memory, every preset replaying the reference; one repeat a call with the order rotated by FIG4_ROTATE (0, 1, 2); a later call at the same load carries the first's reference (COSTED_REF); on a card under 100 GiB the 12-expert build (files _e12); `dhisparse plot` / `dhisparse table` draw Fig. 4 and Tables 2, A2, A3 from the files (~8 min at C30 with the reference decode). Fig. 1 is the same at 32K in / 8K out in the same pool: FIG4_IN=32768 FIG4_OUT=8192 FIG4_POOL=15.6 FIG4_PRESETS=hisparse,adaptive+spec,resident+spec (its first call at a load decodes the 8K-token reference, ~7 min: the file comes back though the windows may not fit)
  faithful_build
  F4="in${FIG4_IN:-102400}_out${FIG4_OUT:-1024}_c${FIG4_C:-9}"
  run "DFlash2 checkpoint (random, paper shape, hidden 6144)" python3 bench/drafter_checkpoint.py --model glm5-faithful --kind dflash2 \
      --layers 6 --block 8 --shape paper-glm5 --out /tmp/dflash2_6l_faithful
  run "Fig. 4, glm5-faithful$FB_TAG, $F4, rotation ${FIG4_ROTATE:-0}" timeout ${FIG4_TIMEOUT:-570} \
      python3 bench/gpu_serving.py --model glm5-faithful $FB_EXTRA --input-len ${FIG4_IN:-102400} --output-len ${FIG4_OUT:-1024} \
      ${FIG4_POOL:+--kv-pool-gib $FIG4_POOL} $FB_POOL --concurrency ${FIG4_C:-9} \
      --presets ${FIG4_PRESETS:-resident,hisparse,adaptive,resident+spec,adaptive+spec} --repeats 1 --rotate ${FIG4_ROTATE:-0} \
      --duration 30 --stagger --distinct-suffixes ${FIG4_C:-9} --force --charge-spec-memory --spec-width 4 \
      --spec-tokens-per-round 2.88 --engine-arg speculative_oracle_drafter=dflash2 \
      --engine-arg speculative_draft_model_path=/tmp/dflash2_6l_faithful --replay-reference \
      --reference-file "${COSTED_REF:-$OUT/oracle_reference_faithful${FB_TAG}_$F4.json}" \
      --out "$OUT/fig4_faithful${FB_TAG}_k2048_${F4}_r${FIG4_ROTATE:-0}_h200.json" ;; esac
case ",$STEPS," in *,fig10_31,*)  # issue 31's Fig. 10 at the paper's setting: adaptive's decode step at high load (C${FIG10_C:-18}) on glm5-faithful at 100K, k 2,048, FP8 rows, the costed sweep's pool (15.6 GiB), profiled at each hot-cache budget of FIG10_B (default 4096; 2048 4096 8192 16384 = k ... 8k over two or more calls, one process a budget); `dhisparse plot` draws cache_work.png (Fig. 10a: resolver + follower-copy kernel ms per step and per session against B) from the files and step_profile.png (Fig. 10b) from each; the 12-expert build on a card under 100 GiB (~3 min a budget)
  faithful_build
  for B in ${FIG10_B:-4096}; do
    run "Fig. 10, glm5-faithful$FB_TAG, adaptive C${FIG10_C:-18}, B $B" timeout ${FIG10_TIMEOUT:-300} python3 bench/step_profile.py \
        --model glm5-faithful $FB_EXTRA --input-len 102400 --concurrency ${FIG10_C:-18} --steps 6 --warmup 3 --top 40 \
        --presets ${FIG10_PRESETS:-adaptive} --kv-cache-dtype fp8_e4m3 --kv-pool-gib 15.6 --host-pool-gib 16 \
        --max-batched-tokens $FB_MBT --cuda-graphs step --hot-cache-rows $B \
        --out "$OUT/fig10_faithful${FB_TAG}_100k_k2048_c${FIG10_C:-18}_B${B}_h200.json"
  done ;; esac
case ",$STEPS," in *,loadstep31,*)  # issue 31's Fig. 6 / Table A1 at the paper's setting: the load step C${LOADSTEP31_LOW:-2} -> C${LOADSTEP31_HIGH:-18} -> C${LOADSTEP31_LOW:-2} (phases ${LOADSTEP31_S:-30,60,60} s) on glm5-faithful at 100K, k 2,048, FP8 rows, the costed sweep's pool (3 resident histories), residency on (adaptive) and off (hisparse), one repeat a call with the order rotated by LOADSTEP31_ROTATE (0, 1, 2); on a card under 100 GiB the 12-expert build (files _e12); `dhisparse plot` draws loadstep.png, `dhisparse table` the per-phase statistics (~6 min)
  faithful_build
  run "Fig. 6 load step, glm5-faithful$FB_TAG, C${LOADSTEP31_LOW:-2} -> C${LOADSTEP31_HIGH:-18}, rotation ${LOADSTEP31_ROTATE:-0}" \
      timeout ${LOADSTEP31_TIMEOUT:-570} python3 bench/gpu_serving.py $FB_100K \
      --load-step ${LOADSTEP31_LOW:-2},${LOADSTEP31_HIGH:-18} --load-step-s ${LOADSTEP31_S:-30,60,60} \
      --presets adaptive,hisparse --repeats 1 --rotate ${LOADSTEP31_ROTATE:-0} --distinct-suffixes ${LOADSTEP31_HIGH:-18} \
      --force --out "$OUT/loadstep_faithful${FB_TAG}_100k_k2048_r${LOADSTEP31_ROTATE:-0}_h200.json" ;; esac
case ",$STEPS," in *,drafter34,*)  # issue 31: the DFlash drafter's grouped attention and block-pass CUDA graphs (session 34): CUDA exactness of the drafter files, then a round of the paper's DFlash2 shape on glm5-faithful's hidden / vocabulary at C20 and C47, per_head (the named baseline) / grouped / graph (~5 min cold)
  run "exactness on CUDA, drafter files" timeout ${EXACT34_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/test_dflash_graphs.py tests/test_dflash_attention.py tests/test_dflash_reference.py tests/test_spec_dflash.py tests/test_drafters_models.py \
      tests/test_spec_engine.py tests/test_dspark_head.py tests/test_costed_oracle.py tests/test_spec_ring.py tests/test_train_drafter.py \
      tests/test_drafter_cost.py tests/test_spec_commit_many.py --junitxml="$OUT/exact34_cuda.xml"
  for C in ${DRAFTER34_C:-20 47}; do
    run "drafter round, paper-glm5 DFlash2, C$C" timeout ${DRAFTER34_TIMEOUT:-150} python3 bench/drafter_round.py --model glm5-faithful \
        --shape paper-glm5 --requests $C --out "$OUT/drafter_round_paperglm5_c${C}_h200.json"
  done ;; esac
case ",$STEPS," in *,exact42,*)  # session 42's changes on CUDA: reference replay (engine step's sampling and rounds), the round's timing, the drafter's anchors and ring rows without a stream sync (~3 min cold)
  run "exactness on CUDA, session 42's files" timeout ${EXACT42_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/test_replay.py tests/test_spec_engine.py tests/test_engine.py tests/test_spec_ring.py tests/test_spec_dflash.py \
      tests/test_drafters_models.py tests/test_dspark_head.py tests/test_costed_oracle.py tests/test_dflash_graphs.py \
      tests/test_spec_policy.py tests/test_step_graphs.py --junitxml="$OUT/exact42_cuda.xml" ;; esac
case ",$STEPS," in *,exact45,*)  # session 45's changes on CUDA: the drafter ring's row offsets as a host list (RingAllocator.rows_batch: every DFlash / DSpark commit), the commits' context projection from CUDA graphs (IngestGraphs), the FP8 kernels' profile families (~3 min cold)
  run "exactness on CUDA, session 45's files" timeout ${EXACT45_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/test_spec_ring.py tests/test_spec_commit_many.py tests/test_spec_dflash.py tests/test_spec_engine.py \
      tests/test_costed_oracle.py tests/test_dflash_graphs.py tests/test_drafters_models.py tests/test_dspark_head.py \
      tests/test_fp8_gemm.py tests/test_drafter_cost.py --junitxml="$OUT/exact45_cuda.xml" ;; esac
case ",$STEPS," in *,exact44,*)  # session 44's changes on CUDA: read_rows to host a layer at a time (981cd47: prefix export, disaggregation's hand-off), --fp8-activations auto (82cdb11: the faithful models' default w8a8) (~3 min cold)
  run "exactness on CUDA, session 44's files" timeout ${EXACT44_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/test_prefix_pages.py tests/test_disagg.py tests/test_disagg_v4.py tests/test_disagg_ep.py tests/test_v4_prefix.py \
      tests/test_engine.py tests/test_hierarchy.py tests/test_fp8_w8a8.py tests/test_faithful_model.py tests/test_v41_faithful.py \
      tests/test_adaptive.py --junitxml="$OUT/exact44_cuda.xml" ;; esac
case ",$STEPS," in *,exact33,*)  # issue 33: CUDA exactness of every file the resolver plan / workspace reaches (~2 min warm); EXACT33_REUSE=1: with the plans' output blocks kept (DHISPARSE_PLAN_OUTPUT_REUSE=1, session 50's experiment; tests/test_resolver_outputs.py too)
  run "exactness on CUDA, resolver files${EXACT33_REUSE:+, output blocks kept}" env DHISPARSE_PLAN_OUTPUT_REUSE=${EXACT33_REUSE:-0} \
      timeout ${EXACT33_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n 8 --dist loadfile \
      tests/test_resolver_kernel.py tests/test_resolver_one.py tests/test_resolver_reference.py tests/test_hierarchy.py tests/test_step_graphs.py \
      tests/test_prefetch.py tests/test_staging_paper.py tests/test_v4_resolver_step.py tests/test_v4_sources.py \
      tests/test_adaptive.py tests/test_source_budgets.py tests/test_spec_engine.py tests/test_graphs.py tests/test_uva.py \
      tests/test_v4_hier.py tests/test_spec_mtp.py tests/test_spec_mtp_v4.py tests/test_spec_dflash.py tests/test_kv_fp8*.py tests/test_launch.py \
      tests/test_gather.py tests/test_resolver_fused_copy.py tests/test_resolver_hot_entry.py \
      tests/test_resolver_bound.py tests/test_resolver_outputs.py tests/test_resolver_miss_order.py \
      --junitxml="$OUT/exact33${EXACT33_REUSE:+_reuse}_cuda.xml" ;; esac
case ",$STEPS," in *,exact33r,*)  # issue 33: the resolver's own files only, on CUDA (~1.5 min warm)
  run "exactness on CUDA, resolver kernel files" timeout ${EXACT33_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -n 8 \
      tests/test_resolver_kernel.py tests/test_resolver_one.py tests/test_resolver_reference.py tests/test_hierarchy.py tests/test_launch.py \
      tests/test_gather.py tests/test_resolver_fused_copy.py tests/test_resolver_hot_entry.py tests/test_staging_paper.py \
      tests/test_resolver_miss_order.py --junitxml="$OUT/exact33r_cuda.xml" ;; esac
case ",$STEPS," in *,gemm43,*)  # issue 31: FP8 GEMM tiles BM 64 vs 128 at verification pass sizes (s42's round: dense GEMMs 2.43x the step's for 5x the rows: BM 64 reads each weight twice at 100 rows) (~2 min)
  run "FP8 GEMM tiles, BM 64 vs 128" timeout ${GEMM43_TIMEOUT:-200} python3 bench/fp8_gemm_bench.py --tokens 20,100 --prefill-tokens 0 \
      --sweep-tokens 20,47,100,188 --sweep "64:4:3,64:64:4:3,128:64:4:3,128:64:8:3,128:128:8:3,128:64:4:4" --out "$OUT/fp8_gemm_tiles_bm_h200.json" ;; esac
case ",$STEPS," in *,w8a843,*)  # issue 31: FP8 activations (--fp8-activations dynamic, kernels/fp8_w8a8.py): CUDA exactness of the FP8 GEMM files and glm5-faithful's presets under both settings, then w8a16 / w8a8 / bf16 GEMM times at decode and verification pass sizes (~2.5 min cold); the default is w8a8 since session 44 (--fp8-activations auto), the round without it: round31 with ROUND31_ARGS="--engine-arg fp8_activations=none" ROUND31_TAG=_w8a16
  run "exactness on CUDA, FP8 GEMM files" timeout ${W8A8_EXACT_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -n 6 --dist loadfile \
      tests/test_fp8_w8a8.py tests/test_fp8_gemm.py tests/test_fp8_modules.py tests/test_faithful_model.py tests/test_moe.py tests/test_ep_fp8.py \
      --junitxml="$OUT/w8a843_cuda.xml"
  run "FP8 GEMMs: w8a16 / w8a8 / bf16" timeout ${W8A8_BENCH_TIMEOUT:-200} python3 bench/fp8_gemm_bench.py --tokens 20,47,100,188 --prefill-tokens 8192 \
      --sweep "" --out "$OUT/fp8_gemm_w8a8_h200.json" ;; esac
case ",$STEPS," in *,peer33,*)  # issue 33: the cases against the peer's figures, with the phase profile (~1 min warm)
  run "resolver vs the peer's figures" timeout ${PEER33_TIMEOUT:-240} python3 bench/resolver_peer.py --phases \
      --out "$OUT/resolver_peer_h200.json" ;; esac
case ",$STEPS," in *,peerlive33,*)  # issue 33: ours (scan and hot_entry index states, plan + copy and fused) against SGLang 0.5.23's HiSparse kernel run here, side by side on the 36 cases (the peer built from its wheel on the CPU first: python3 bench/peer/build.py; carry [".whl", ".peer"]; ~4 min cold; session 51's two-form run took 53 s warm)
  [ -f .peer/libhisparse_peer.so ] || { echo "peerlive33: .peer/libhisparse_peer.so missing (bench/peer/build.py, carry .peer)"; exit 2; }
  # PEERLIVE33_ARGS: e.g. --cases '_N8_.*1152B|20%_N32' --iters 60 --rounds 12 (repeats of the copy-bound cases)
  run "resolver vs the peer's kernel, side by side" timeout ${PEERLIVE33_TIMEOUT:-480} python3 bench/resolver_peer_live.py \
      ${PEERLIVE33_ARGS:-} --out "$OUT/resolver_peer_live_h200.json" ;; esac
case ",$STEPS," in *,probe33,*)  # issue 33: the plan stopped after each phase, and across num_warps (~3 min cold)
  run "resolver plan probe" timeout ${PROBE33_TIMEOUT:-240} python3 bench/resolver_probe.py \
      --out "$OUT/resolver_probe_h200.json" ;; esac
case ",$STEPS," in *,prims33,*)  # issue 33: one program's Triton primitives (scan, reduce, gathers, sort, atomics) (~1 min)
  run "Triton primitives" timeout ${PRIMS33_TIMEOUT:-200} python3 bench/triton_prims.py --out "$OUT/triton_prims_h200.json" ;; esac
case ",$STEPS," in *,ncu33,*)  # issue 33: where the plan kernel stalls: ncu's counters and source-level stall samples on one plan call, batch 8, H 4,096, 0.1% and 20% misses (~3 min; ncu reads counters on the Firecracker runtime only: KINDS.md)
  for lvl in ${NCU33_LEVELS:-0.1 20}; do
    rep="$OUT/plan_ncu_miss${lvl}"
    # launch-skip: check_case's plan and the 5 warm-up calls (one plan launch each); sampling interval 0 = every
    # 32 cycles (s34's default interval gave 128 samples for a ~20-us kernel: too few to rank lines)
    run "ncu: plan kernel, ${lvl}% misses" timeout ${NCU33_TIMEOUT:-150} ncu --clock-control none \
        --kernel-name regex:resolve_plan_kernel --launch-skip 6 --launch-count 1 --set full --import-source yes \
        --warp-sampling-interval ${NCU33_SAMPLING:-0} -f -o "$rep" \
        python3 bench/resolver_one_call.py --level "${lvl}%" --batch 8 ${NCU33_ARGS:-}
    ncu --import "$rep.ncu-rep" --page details > "${rep}_details.txt" 2>&1 || true
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "${rep}_source.csv" 2>&1 || true
    python3 bench/ncu_top.py "${rep}_source.csv" --top 60 --json "${rep}_top.json" > "${rep}_top.txt" 2>&1 || true
  done ;; esac
case ",$STEPS," in *,multi33,*)  # issue 33: the multi-query and all-direct cases, same script as s16b's result (~4 min)
  run "resolver bench (K 8 unions, direct)" timeout ${MULTI33_TIMEOUT:-300} python3 bench/resolver_bench.py ${MULTI33_ARGS:-} \
      --out "$OUT/resolver_bench_h200.json" ;; esac
case ",$STEPS," in *,step33,*)  # issue 33: the resolver's share of a 100K k 2048 decode step (hisparse) and verification round
  # (adaptive+spec, width 4, a placeholder oracle: every round verifies the full width), fp8profile100k's C47, with the
  # producer's copies in their own gather launch and fused into the plan kernel (--resolver-copy; ~2.5 min each)
  # STEP33_LOOKUPS: the hot-cache hits scanned for and / or looked up (--resolver-lookup scan index)
  for RC in ${STEP33_COPIES:-separate fused}; do for LK in ${STEP33_LOOKUPS:-scan}; do
  run "decode-step profile, 100K k 2048, C47, fp8, resolver copy $RC, lookup $LK" timeout ${STEP33_TIMEOUT:-220} python3 bench/step_profile.py \
      --model glm52-scaled --input-len 102400 --concurrency 47 --steps 5 --warmup 3 --presets ${STEP33_PRESETS:-hisparse,adaptive+spec} \
      --drafter oracle --kv-cache-dtype fp8_e4m3 \
      --kv-pool-gib 27.4166 --host-pool-gib 24 --cuda-graphs step --resolver-copy $RC --resolver-lookup $LK \
      --out "$OUT/step_profile_100k_k2048_c47_fp8_e4m3_copy_${RC}_${LK}_h200.json"
  done; done ;; esac
case ",$STEPS," in *,specpolicy,*)  # issue 26 item 6: eq. 13's online width policy (K_max 8) vs fixed widths 2/4/6/8, 8K, C2 / C6 / C11
  # s19: C18 and C36 both ran 10 active (the device holds 11 sessions at --resident-fit 6): loads within the
  # device's slots, a 32-GiB host pool. Every arm in one process: one oracle acceptance for every width (the
  # corruption rate that gives 2.88 tokens a round at width 4, so width K is calibrated to what that rate gives
  # at K; a MEASUREMENT TOOL: the oracle runs no network), the arm order rotated every round. Whole-step graphs
  # are captured before serving (s21: lazily, the online arm captured ~7 graphs, ~2.3 s, some inside its 10-s window),
  # each run only for its load's batch sizes (--graph-max-bs-per-load: s21's warm-up of every bucket up to 11 slots
  # took 166 s an online engine). Fixed 2 is left out by default: s21 it was the slowest width at C2 and C11 by >= 10%.
  # --prewarm: s22's first speculative engine captured at 2-8 s a graph (later ones 0.35 s), so every arm is built
  # once, unmeasured, first. One load a call (SPEC_C=2, 6 or 11): three rounds of four arms took a whole call at C11
  tpr() { python3 -c "import dhisparse.spec.oracle as o; c = o.corrupt_rate_for_tokens_per_round(2.88, 4); print(round(o.expected_tokens_per_round(1 - c, $1), 4))"; }
  arm() { echo "speculative_policy=$1,speculative_num_draft_tokens=$2,speculative_oracle_tokens_per_round=$(tpr $2)"; }
  ARMS=""; for POL in ${SPECPOLICY_ORDER:-online:8 fixed:4 fixed:6 fixed:8}; do ARMS="$ARMS;$(arm ${POL%%:*} ${POL##*:})"; done
  run "adaptive+spec, online K_max 8 vs fixed widths, 8K C${SPEC_C:-2,6,11}" timeout ${SPECPOLICY_TIMEOUT:-540} \
      python3 bench/gpu_serving.py --model glm52-scaled --input-len 8192 --resident-fit 6 --host-pool-gib 32 \
      --concurrency ${SPEC_C:-2,6,11} --presets adaptive+spec --duration 10 --force --spec-width 4 --arms "${ARMS#;}" \
      --engine-arg step_graph_warmup=true --graph-max-bs-per-load --prewarm \
      --repeats ${SPECPOLICY_REPEATS:-1} --out "$OUT/spec_policy_8k_c${SPEC_C:-2,6,11}_h200.json" ;; esac
# Fig. 5 on v41-faithful (issue 31): output against context at one concurrency, resident vs the hierarchy, FP8 rows;
# one context a call: fig5v41a 32K, b 64K, c 128K, d 256K, e 512K, and 1M in two halves (f: resident + hisparse,
# g: adaptive + adaptive+spec). The KV pool is FIG5_POOL_GIB (16; 12 on a card under 100 GB: `fig5_pool`) at every context (--kv-pool-gib: --resident-fit
# becomes the histories it holds), so resident holds 350 / 210 / 131 / 75 / 38 / 20 sessions at 32K ... 1M and the
# hierarchy 643 / 504 / 349 / 217 / 119 / 65 (dhisparse/bench/sizing.py on the meta device): at C${FIG5_C:-64} resident
# queues from 512K while the hierarchy holds every client. The host pools stay under 1 GiB (the prefix's row pages
# are shared on host: 18 MiB at 32K, 557 MiB at 1M, and 0.3 MiB a request), far inside the host's 128 GiB: the
# model's 1,048,576 positions bound the context, not host memory. adaptive+spec is the costed oracle with DSpark's
# network (a MEASUREMENT TOOL: 2.88 tokens a round at width 4; the drafter runs every round and holds its memory,
# charged out of the pool by --charge-spec-memory): the factory's seeded random DSpark for the target (2 layers at
# hidden 4,096: 0.70 GiB, 68 MiB of ring a slot), as bench/drafter_checkpoint.py cannot write a V4-shaped checkpoint
# (its builtin_config is GLM-only). UNTRIED: v41-faithful has not been served on a GPU (its greedy decoding and locality ran on an H100, session 38); gpu_serving's estimate guesses its
# build and prefill (V4_BUILD_S, V4_PREFILL_TOK_S), 230-450 s a step. Draw: dhisparse plot $OUT/fig5_v41_*.json --out fig5/
fig5_pool() {  # Fig. 5's KV pool, GiB: FIG5_POOL_GIB, else 16 on a card from 100 GB and 12 below it (an H100: the
  # 57.3-GiB weights, 16 GiB and a 1M prefill's workspace would leave almost none of its ~79 GiB; 12 is a margin, not
  # measured); a pool other than 16 tags the files _poolN
  F5_POOL=${FIG5_POOL_GIB:-$(small_card && echo 12 || echo 16)}
  F5_TAG=$([ "$F5_POOL" = 16 ] || echo "_pool$F5_POOL")
}
fig5v41() {  # $1 input length, $2 presets, $3 file tag
  fig5_pool
  run "Fig. 5, v41-faithful, $1 tokens, C${FIG5_C:-64}, ${F5_POOL}-GiB pool, fp8 rows, $2" timeout ${FIG5_TIMEOUT:-570} \
      python3 bench/gpu_serving.py --model v41-faithful --input-len $1 --output-len 256 --kv-pool-gib $F5_POOL \
      --concurrency ${FIG5_C:-64} --presets $2 --duration ${FIG5_DURATION:-20} --distinct-suffixes 8 --kv-cache-dtype fp8_e4m3 \
      --max-batched-tokens 8192 --charge-spec-memory --spec-width 4 --engine-arg speculative_oracle_drafter=dspark \
      --reference-file "$OUT/oracle_reference_v41_$1.json" --force --out "$OUT/fig5_v41_faithful_$1_c${FIG5_C:-64}_fp8$F5_TAG${3:-}_h200.json"
}
FIG5_ALL=resident,hisparse,adaptive,adaptive+spec
case ",$STEPS," in *,fig5v41a,*) fig5v41 32768 $FIG5_ALL ;; esac
case ",$STEPS," in *,fig5v41b,*) fig5v41 65536 $FIG5_ALL ;; esac
case ",$STEPS," in *,fig5v41c,*) fig5v41 131072 $FIG5_ALL ;; esac
case ",$STEPS," in *,fig5v41d,*) fig5v41 262144 $FIG5_ALL ;; esac
case ",$STEPS," in *,fig5v41e,*) fig5v41 524288 $FIG5_ALL ;; esac
case ",$STEPS," in *,fig5v41f,*) fig5v41 1000000 resident,hisparse _f ;; esac
case ",$STEPS," in *,fig5v41g,*) fig5v41 1000000 adaptive,adaptive+spec _g ;; esac
