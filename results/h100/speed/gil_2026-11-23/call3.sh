#!/usr/bin/env bash
# session 16 A/B: old = f31e89f (AdamW's call holds the GIL), new = b9c10a3 (cpp_wrapper: released)
set -u
G=workflows/grids/h100-speed.yaml
strip() { python -m workflows.scripts.grid $G "$1" | sed 's/ trace=[^ ]*//'; }
A=$(strip short_step/7b_4seq_auto); S=$(strip short_step/7b_4seq_auto_slabs8); B=$(strip device_tiles/7b_16seq_mb8_K1_dt3)
mkdir -p $OUT/old $OUT/new
run() { # tree name end_by args...
  local tree=$1 name=$2 end=$3; shift 3
  local left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "skip $tree/$name: $left s left"; return; }
  ( [ $tree = old ] && cd .ab/old; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tree TRITON_CACHE_DIR=/tmp/tri_$tree
    MEGATRAIN_GIT_COMMIT=$([ $tree = old ] && echo f31e89f || echo b9c10a3) timeout $left python -m suite run "$@" trace=$OUT/$tree/$name.trace.json --out $OUT/$tree/$name.json > $OUT/$tree/$name.log 2>&1 )
  echo "$tree/$name rc $? at $SECONDS s"
}
run old 7b_4seq_auto 560 $A
run new 7b_4seq_auto 560 $A
run new 7b_4seq_auto_slabs8 560 $S
run new 7b_16seq_mb8_K1_dt3 575 $B
python -m suite table $OUT/old $OUT/new
