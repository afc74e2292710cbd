#!/usr/bin/env bash
# session 17, issue 24: grad_slabs auto (8 where the host holds them) and the ceiling measured after
# the host's updates (new, this tree) against 994cd4a (4 slabs; .ab/old), the defaults at 7B 4 x 4096;
# then the 7B target point (16 x 4096) on the new tree with its trace: the final step's timeline.
set -u
G=workflows/grids/h100-speed.yaml
pt() { python -m workflows.scripts.grid $G "$1" | sed 's/ trace=[^ ]*//'; }
A=$(pt short_step/7b_4seq_auto); B=$(pt device_tiles/7b_16seq_mb8_K1_dt3)
mkdir -p $OUT/old $OUT/new
run() { # tree name end_by trace(0/1) args...
  local tree=$1 name=$2 end=$3 tr=$4; shift 4
  local left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "skip $tree/$name: $left s left"; return; }
  local t=(); [ $tr = 1 ] && t=(trace=$OUT/$tree/$name.trace.json)
  ( [ $tree = old ] && cd .ab/old; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tree TRITON_CACHE_DIR=/tmp/tri_$tree
    MEGATRAIN_GIT_COMMIT=$([ $tree = old ] && echo 994cd4a || echo $C) timeout $left python -m suite run "$@" "${t[@]}" --out $OUT/$tree/$name.json > $OUT/$tree/$name.log 2>&1 )
  echo "$tree/$name rc $? at $SECONDS s"
}
run old 7b_4seq_auto 185 0 $A
run new 7b_4seq_auto 340 1 $A
run new 7b_16seq_mb8_K1_dt3 585 1 $B
python -m suite table $OUT/old $OUT/new
