#!/usr/bin/env bash
# Prepared in session 21: the calls after `x2_call1.sh` on `nvidia-h200-x2`, in the order of
# results/h200/README.md ("what is left": issue targets first, then the grid by group, cheapest
# first, the long detached runs last), carrying [".whl", ".libaio"]:
#   C=<commit> bash results/h200/next/x2_calls.sh start N     then within 30 s of each reply:
#   bash results/h200/next/x2_calls.sh attach                 (extract each reply's workflow.tgz first)
# One GPU a point (the profile's `host` resource runs one at a time: each run's CPU AdamW and host
# memory bandwidth are part of what it measures). A batch's targets come from one grid (the
# h200-scale ones with $S). Batch 1 (the refusals, short_step, moe) ran in session 24, in about 25
# device minutes. Estimated walls of the rest (the README's table, at 5 measured steps after 2; the
# grids now measure 3 after 1, so less): batch 2 about 27, 3 about 20, 4 about 37, 5 about 27; 6 (the 120B MoE point, then one step of 7B at 512K: about 12 minutes) detached;
# 7 ran in session 26: ZeRO-Infinity at 7B filled this disk in its first step, and with the disk's
# reserve its admission refuses it in 21 s; 8 (the h200 grid's) is refused alike; 9 the lean experts'
# MoE point.
# The carried folders are git-ignored and a new checkout lacks them: `.whl` from the workshop's
# device-wheels script, `.libaio` by `baselines/libaio.sh fetch .libaio` (ZeRO-Infinity, Ratel),
# `.ratel/LoHan` from RC4ML/LoHan (batch 2's Ratel points, experiments/ratel_gpu.sh; carry it too).
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan \
  MEGATRAIN_HOST_MEMORY_GB=250
S="--config grid=workflows/grids/h200-scale.yaml"
R=results/h200/points
case $1 in
  start)
    case $2 in
      2) experiments/workflow_gpu.sh --detach $((550 - SECONDS)) h200 $R/ratel/1b_ratel_cpu.json $R/ratel/1b_ratel_disk.json \
           $R/width/w1.0_megatrain.json $R/width/w1.5_megatrain.json $R/width/w2.0_megatrain.json \
           $R/width/w2.5_megatrain.json $R/width/w3.0_megatrain.json $R/ablations/full.json \
           $R/ablations/K1.json $R/ablations/K1_b96.json $R/ablations/one_buffer.json $R/ablations/sync_grads.json \
           2>&1 | tail -12 ;;
      3) experiments/workflow_gpu.sh --detach $((550 - SECONDS)) h200 $R/context/ctx1k.json $R/context/ctx8k.json \
           $R/context/ctx32k.json $R/context/ctx128k.json $R/context/ctx256k.json 2>&1 | tail -12 ;;
      4) experiments/workflow_gpu.sh --detach $((550 - SECONDS)) h200 $R/depth/L28_megatrain.json $R/depth/L42_megatrain.json \
           $R/depth/L56_megatrain.json $R/scale/14b_megatrain.json $R/scale/7b_native.json $R/scale/7b_zero3.json \
           $R/depth/L28_zero3.json $R/depth/L28_fsdp2.json 2>&1 | tail -12 ;;
      5) experiments/workflow_gpu.sh --detach $((550 - SECONDS)) h200 $R/width/w1.0_zero3.json $R/width/w1.0_fsdp2.json \
           $R/width/w1.5_zero3.json $R/width/w1.5_fsdp2.json $R/width/w2.0_zero3.json $R/width/w2.0_fsdp2.json \
           2>&1 | tail -12 ;;
      6) # the moe point that failed in session 24 first (dynamo in flex attention's recompile; its error
         # result removed from this copy so that the workflow runs it; dynamo's internal stack kept should it
         # fail again), then issue 21 target 4
         rm -f $R/moe/120b_L3_megatrain.json
         TORCHDYNAMO_VERBOSE=1 experiments/workflow_gpu.sh --detach $((550 - SECONDS)) h200 $R/moe/120b_L3_megatrain.json $R/long_context/ctx512k_L28.json \
           $S 2>&1 | tail -12 ;;
      8) # ZeRO-Infinity's swap at 7B (127.7 GiB) and the disk's reserve (2 GiB) against this disk's 127.8 GiB
         experiments/workflow_gpu.sh 120 h200 $R/scale/7b_zero_infinity.json 2>&1 | tail -12 ;;
      9) # Qwen3-30B-A3B on 24 layers with the lean experts (about 2 minutes; predicted in the grid: about 296)
         experiments/workflow_gpu.sh --detach $((550 - SECONDS)) h200 $R/moe/q30b_L24_lean_megatrain.json $S 2>&1 | tail -12 ;;
    esac ;;
  attach)
    experiments/workflow_gpu.sh --attach $((550 - SECONDS)) h200 2>&1 | tail -8 ;;
esac
python3 -m suite table $R/short_step $R/moe $R/ratel $R/width $R/ablations $R/context $R/depth $R/scale 2>&1 | tail -30
