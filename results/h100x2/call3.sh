#!/usr/bin/env bash
# Session 20, the third call on `nvidia-h100-x2`, carrying .ab (the optimizer of 21ab4a6, first come
# first served): 14B at 4 x 4096 with 3 device tiles, the CPU optimizer first-come (21ab4a6) and in
# the next forward's order (this tree), one after the other. Prediction, from call 2's trace: the
# step from 4.22 s to 3.5-3.7 s, 371 to 425-450 model TFLOP/s, GPU busy from 0.78 to 0.89-0.94.
# Run as: C=<commit> bash results/h100x2/call3.sh
set -u
export MEGATRAIN_GIT_COMMIT=$C TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
D=$OUT/short_step; mkdir -p $D
G=workflows/grids/h200-scale.yaml
pt() { python3 -m workflows.scripts.grid $G short_step/14b_4seq_dt3 | sed 's/ --timeout [0-9]*//; s/--steps 5 --warmup 2/--steps 4 --warmup 1/; s#results/h200/points/short_step/14b_4seq_dt3#'$D/$1'#'; }
run() { # name end_by args...: the harness's timeout 20 s before the slot ends, the kill 20 s after it
  local name=$1 end=$2; shift 2
  local left=$((end - SECONDS)); [ $left -lt 90 ] && { echo "skip $name: $left s left"; return; }
  timeout $((left + 20)) python3 -m suite run "$@" --timeout $((left - 20)) --out $D/$name.json >> $D/commands.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
cp megatrain/optim.py /tmp/optim_new.py && cp .ab/megatrain/optim.py megatrain/optim.py
run 14b_4seq_dt3_fifo 210 $(pt 14b_4seq_dt3_fifo)
cp /tmp/optim_new.py megatrain/optim.py
run 14b_4seq_dt3_order 405 $(pt 14b_4seq_dt3_order)
python3 -m suite table $D 2>&1 | tail -4
echo "done at $SECONDS s"
