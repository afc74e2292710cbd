#!/usr/bin/env bash
# Prepared in session 20 for a 256 GiB host (`nvidia-h100-x2`, or one GPU of `nvidia-h200-x2`): the
# `moe` experiment of workflows/grids/h200-scale.yaml (issue 23), which needs more host than the
# one-GPU machines' 126 GiB, in two calls of about 570 s. Carry .whl (deepspeed, for ZeRO-3).
# Run as: C=<commit> bash results/h100x2/next/moe_calls.sh 1    (then 2)
# Walls, estimated from session 19's Qwen3-30B-A3B point on the H100 (set-up 80 s at 6 layers, a
# compiled AdamW built 46-71 s on a fresh machine) and the step model, not measured:
#   call 1: q30b_L24 (131K tokens a step: about 110 s set-up, 9 s steps, GPU-bound) 180 s;
#           q30b_L24_8k (the host's AdamW, about 3.8 s a step, binds) 120 s; q30b_L6_zero3 200 s
#   call 2: 120b_L3 (GPT-OSS's first step builds flex attention's kernels: session 19 saw none in
#           66 s) 330 s; 120b_L3_8k 200 s. On an 80 GB H100 the grid's 8 x 4096 micro-batches of
#           120b_L3 need 131.7 GiB of device (`megatrain plan`); the same 131K tokens in 16
#           micro-batches of 2 x 4096 plan at 77.5 GiB, so there it runs as `120b_L3_b2x16`.
set -u
export MEGATRAIN_GIT_COMMIT=$C TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
D=$OUT/moe; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
pt() { python3 -m workflows.scripts.grid workflows/grids/h200-scale.yaml "moe/$1" | sed 's/ --timeout [0-9]*//'; }
run() { # id end_by [name sed]: the harness's timeout 20 s before the slot ends, the kill 20 s after it
  local id=$1 end=$2 name=${3:-$1} edit=${4:-}
  local left=$((end - SECONDS)); [ $left -lt 90 ] && { echo "skip $name: $left s left"; return; }
  timeout $((left + 20)) python3 -m suite run $(pt $id | sed "$edit") --timeout $((left - 20)) --out $D/$name.json \
    >> $D/commands.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
small_gpu=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory < 100 * 2**30))")
case $1 in
  1) run q30b_L24_megatrain 230; run q30b_L24_8k_megatrain 380; run q30b_L6_zero3 575 ;;
  2) if [ "$small_gpu" = 1 ]; then run 120b_L3_megatrain 350 120b_L3_b2x16 "s/--batch 8 --accum 4/--batch 2 --accum 16/"
     else run 120b_L3_megatrain 350; fi
     run 120b_L3_8k_megatrain 575 ;;
esac
python3 -m suite table $D 2>&1 | tail -6
echo "done at $SECONDS s"
