#!/usr/bin/env bash
# session 17, issue 24: the compiled cross-entropy (engine.loss_kernel) on the GPU: its test against
# the eager loss over 20 bf16 steps, then 7B 4 x 4096 (defaults) eager loss (cee076f, .ab/old)
# against compiled (this tree), then 7B 16 x 4096 compiled if the call has room.
set -u
G=workflows/grids/h100-speed.yaml
pt() { python -m workflows.scripts.grid $G "$1" | sed 's/ trace=[^ ]*//'; }
A=$(pt short_step/7b_4seq_auto); B=$(pt device_tiles/7b_16seq_mb8_K1_dt3)
mkdir -p $OUT/old $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k compiled_kernels_track > $OUT/pytest_gpu.txt 2>&1
echo "pytest rc $? at $SECONDS s"; tail -2 $OUT/pytest_gpu.txt
run() { # tree name end_by trace(0/1) args...
  local tree=$1 name=$2 end=$3 tr=$4; shift 4
  local left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "skip $tree/$name: $left s left"; return; }
  local t=(); [ $tr = 1 ] && t=(trace=$OUT/$tree/$name.trace.json)
  ( [ $tree = old ] && cd .ab/old
    MEGATRAIN_GIT_COMMIT=$([ $tree = old ] && echo cee076f || echo $C) timeout $left python -m suite run "$@" "${t[@]}" --out $OUT/$tree/$name.json > $OUT/$tree/$name.log 2>&1 )
  echo "$tree/$name rc $? at $SECONDS s"
}
run old 7b_4seq_auto 330 1 $A
run new 7b_4seq_auto 460 1 $A
run new 7b_16seq_mb8_K1_dt3 590 0 $B
python -m suite table $OUT/old $OUT/new
