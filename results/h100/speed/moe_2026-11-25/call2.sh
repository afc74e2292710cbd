#!/usr/bin/env bash
# Prepared in session 19 for the next one-GPU call (issue 23), what call 1 left: GPT-OSS-120B on one
# layer with time for its first step (call 1: set up in 98 s, no step in the 66 s left), the
# Qwen3-30B-A3B shape at 2 x 4096 where the link should bind, and where the Qwen3-30B-A3B layer's
# time goes (208 model TFLOP/s against about 480 for a dense 7B layer). Run as: C=<commit> bash call2.sh
set -u
G=workflows/grids/h200-scale.yaml
pt() { python -m workflows.scripts.grid $G "$1" | sed 's/ --timeout [0-9]*//'; }
mkdir -p $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_GIT_COMMIT=$C
run() { # name end_by args...: the harness's timeout 30 s before the slot ends, the kill 30 s after it
  local name=$1 end=$2; shift 2
  local left=$((end - SECONDS)); [ $left -lt 90 ] && { echo "skip $name: $left s left"; return; }
  # the harness writes the worker's log beside the result (NAME.log): the command's own lines go
  # elsewhere, or the two writers overwrite each other's bytes in one file
  timeout $((left + 30)) python -m suite run "$@" --timeout $((left - 30)) --out $OUT/new/$name.json \
    >> $OUT/new/commands.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
run 120b_L1_b4 330 $(pt moe/120b_L3_megatrain | sed "s/num_hidden_layers=3/num_hidden_layers=1/; s/--batch 8 --accum 4/--batch 4 --accum 1/") engine.grad_slabs=2
L6=$(pt moe/q30b_L6_megatrain)
run q30b_L6_b2 480 ${L6/--batch 8/--batch 2}
# one layer's forward, recompute and backward at 8 x 4096, its device kernels by kind
timeout $((570 - SECONDS)) python -m experiments.probes.layer_kernels --preset qwen3-30b-a3b --batch 8 --seq 4096 \
  --variants norm --out $OUT/new/q30b_layer_kernels.json 2>&1 | tail -8
python -m suite table $OUT/new
