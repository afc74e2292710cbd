#!/usr/bin/env bash
# session 17, issue 24: 7B at 4 x 4096 with 8 gradient slabs, 15 device tiles against the plan's
# (19), on one machine; then 7B at 16 x 4096 with layers kept from recompute (the stretch route).
set -u
G=workflows/grids/h100-speed.yaml
pt() { python -m workflows.scripts.grid $G "$1" | sed 's/ trace=[^ ]*//'; }
mkdir -p $OUT/new
run() { # name end_by trace(0/1) args...
  local name=$1 end=$2 tr=$3; shift 3
  local left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "skip $name: $left s left"; return; }
  local t=(); [ $tr = 1 ] && t=(trace=$OUT/new/$name.trace.json)
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_GIT_COMMIT=$C \
    timeout $left python -m suite run "$@" "${t[@]}" --out $OUT/new/$name.json > $OUT/new/$name.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
run 7b_4seq_dt15_slabs8 300 1 $(pt short_step/7b_4seq_dt15_slabs8)
run 7b_4seq_auto_slabs8 420 0 $(pt short_step/7b_4seq_auto_slabs8)
run 7b_16seq_mb8_K1_dt3_kept 585 1 $(pt kept/7b_16seq_mb8_K1_dt3_kept)
python -m suite table $OUT/new
