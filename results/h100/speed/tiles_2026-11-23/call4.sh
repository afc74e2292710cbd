#!/usr/bin/env bash
# session 17, issue 24: 7B 4 x 4096 with the defaults at 210f846 (grad_slabs auto, compiled loss)
# twice more on a fresh machine: the spread of the step and of its ceiling.
set -u
A=$(python -m workflows.scripts.grid workflows/grids/h100-speed.yaml short_step/7b_4seq_auto | sed 's/ trace=[^ ]*//')
mkdir -p $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
for i in 1 2; do
  left=$((330 * i - SECONDS)); [ $left -lt 60 ] && { echo "skip run $i"; continue; }
  MEGATRAIN_GIT_COMMIT=$C timeout $left python -m suite run $A --out $OUT/new/7b_4seq_auto_r$i.json > $OUT/new/7b_4seq_auto_r$i.log 2>&1
  echo "run $i rc $? at $SECONDS s"
done
python -m suite table $OUT/new
