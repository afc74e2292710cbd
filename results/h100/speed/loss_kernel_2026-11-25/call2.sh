#!/usr/bin/env bash
# Session 19, issue 24: 7B at 16 x 4096 (8 x 2, 3 device tiles) on one machine, the compiled loss
# (engine.loss_kernel=compiled, call 1's gain): without layers kept from recompute, then with the
# grid's 3 kept layers (traced: the final 7B step's timeline). Run as: C=<commit> bash call2.sh
set -u
G=workflows/grids/h100-speed.yaml
pt() { python -m workflows.scripts.grid $G "$1" | sed 's/ trace=[^ ]*//'; }
mkdir -p $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
run() { # name end_by trace(0/1) args...
  local name=$1 end=$2 tr=$3; shift 3
  local left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "skip $name: $left s left"; return; }
  local t=(); [ $tr = 1 ] && t=(trace=$OUT/new/$name.trace.json)
  MEGATRAIN_GIT_COMMIT=$C timeout $left python -m suite run "$@" "${t[@]}" --out $OUT/new/$name.json > $OUT/new/$name.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
run 7b_16seq_mb8_K1_dt3_loss_compiled 290 0 $(pt device_tiles/7b_16seq_mb8_K1_dt3) engine.loss_kernel=compiled
run 7b_16seq_mb8_K1_dt3_kept_loss_compiled 585 1 $(pt kept/7b_16seq_mb8_K1_dt3_kept) engine.loss_kernel=compiled
python -m suite table $OUT/new
