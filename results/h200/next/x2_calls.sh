#!/usr/bin/env bash
# Prepared in session 21: the calls after `x2_call1.sh` on `nvidia-h200-x2`, in the order of
# results/h200/README.md ("what is left": issue targets first, then the grid by group, cheapest
# first, the long detached runs last), carrying [".whl", ".libaio"]:
#   C=<commit> bash results/h200/next/x2_calls.sh start N [M ...]   then within 30 s of each reply:
#   bash results/h200/next/x2_calls.sh attach [SECONDS]       (extract each reply's workflow.tgz first;
#                                                             SECONDS, default 550: less where device time is short)
# One GPU a point (the profile's `host` resource runs one at a time: each run's CPU AdamW and host
# memory bandwidth are part of what it measures). Batches 2-5 are the h200 grid's, and `start 2 3 4`
# runs them in that order in one detached run: the session's device time, not a batch's end, sets
# how far it goes. Batch 9 is h200-scale's ($S) and runs alone. A `start` is alone in its call: it
# returns 540 s after its own start, the wheels' install and the tree's copy included, and packs;
# anything before it in the call would take the call past its 10-minute limit, and that call's pack
# would never come back (session 27; the detached run, in its own tree since then, keeps what it wrote).
# Estimated walls (results/h200/README.md's table at 5 measured steps after 2; the grids now measure
# 3 after 1, so less): batch 2 about 20 minutes (Ratel's two 1B points, width w2.5 and w3.0, the
# ablations), 3 about 20, 4 about 37, 5 about 27; 9 the lean experts' MoE point (about 2). Batches 1,
# 6, 7 and 8 have run (sessions 24-27).
# The carried folders are git-ignored and a new checkout lacks them: `.whl` from the workshop's
# device-wheels script, `.libaio` by `baselines/libaio.sh fetch .libaio` (ZeRO-Infinity, Ratel),
# `.ratel/LoHan` from RC4ML/LoHan (batch 2's Ratel points, experiments/ratel_gpu.sh; carry it too).
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan \
  MEGATRAIN_HOST_MEMORY_GB=250
S="--config grid=workflows/grids/h200-scale.yaml"
R=results/h200/points
B2="$R/ratel/1b_ratel_cpu.json $R/ratel/1b_ratel_disk.json $R/width/w2.5_megatrain.json $R/width/w3.0_megatrain.json
    $R/ablations/full.json $R/ablations/K1.json $R/ablations/K1_b96.json $R/ablations/one_buffer.json $R/ablations/sync_grads.json"
B3="$R/context/ctx1k.json $R/context/ctx8k.json $R/context/ctx32k.json $R/context/ctx128k.json $R/context/ctx256k.json"
B4="$R/depth/L28_megatrain.json $R/depth/L42_megatrain.json $R/depth/L56_megatrain.json $R/scale/14b_megatrain.json
    $R/scale/7b_native.json $R/scale/7b_zero3.json $R/depth/L28_zero3.json $R/depth/L28_fsdp2.json"
B5="$R/width/w1.0_zero3.json $R/width/w1.0_fsdp2.json $R/width/w1.5_zero3.json $R/width/w1.5_fsdp2.json
    $R/width/w2.0_zero3.json $R/width/w2.0_fsdp2.json"
case $1 in
  start)  # start N [M ...]: batches 2-5 (the h200 grid's) one after another in one detached run; 9 alone
    # where a point's 12-15 s of start (start_s) go, before the run (its seconds come off the run's wait):
    # the worker's imports, module by module (4.0 s on the 2-core CPU machine: torch 1.1, transformers
    # through megatrain.shapes 2.7). Prediction: imports 8-11 s here, the rest of start_s the interpreter
    # and env_s (the GPU's first touch, NVML, git), now timed apart in every point.
    python3 -X importtime -c "import suite.worker" 2> "${OUT:-/tmp}/importtime.txt"; tail -1 "${OUT:-/tmp}/importtime.txt"
    if [ "$2" = 9 ]; then
      # Qwen3-30B-A3B on 24 layers with the lean experts (about 2 minutes; predicted in the grid: about 296)
      T="$R/moe/q30b_L24_lean_megatrain.json $S"
    else
      for n in "${@:2}"; do case $n in 2|3|4|5) ;; *) echo "batches 2-5 chain; 9 runs alone"; exit 1 ;; esac; done
      # each batch one snakemake (a comma-joined group), but Ratel's points first, alone
      T=$(shift; for n in "$@"; do v=B$n; echo ${!v} | tr ' ' '\n' | grep -v /ratel/ | paste -sd, -; done)
      case " ${*:2} " in *" 2 "*) T="$R/ratel/1b_ratel_cpu.json $R/ratel/1b_ratel_disk.json $T" ;; esac
    fi
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h200 $T 2>&1 | tail -40 ;;
  attach)  # the detached run's table is printed by workflow_gpu.sh
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h200 2>&1 | tail -40 ;;
esac
