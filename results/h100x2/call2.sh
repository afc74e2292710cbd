#!/usr/bin/env bash
# Session 20, the second call on `nvidia-h100-x2`, carrying .whl: what call 1 cut short. Its slots had
# counted on the H200's 50 s of set-up; here 14B set itself up in 98-126 s (the compiled AdamW's
# build among it) and was cut after 2 of 7 steps; pytest's output was lost (block-buffered into
# tee when the timeout killed it). Run as: C=<commit> bash results/h100x2/call2.sh
set -u
export MEGATRAIN_GIT_COMMIT=$C TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
D=$OUT/short_step; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
G=workflows/grids/h200-scale.yaml
pt() { python3 -m workflows.scripts.grid $G "$1" | sed 's/ --timeout [0-9]*//; s#results/h200/points/short_step#'$D'#'; }
run() { # name end_by args...: the harness's timeout 30 s before the slot ends, the kill 30 s after it
  local name=$1 end=$2; shift 2
  local left=$((end - SECONDS)); [ $left -lt 90 ] && { echo "skip $name: $left s left"; return; }
  timeout $((left + 30)) python3 -m suite run "$@" --timeout $((left - 30)) --out $D/$name.json >> $D/commands.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
run 14b_4seq_dt3 300 $(pt short_step/14b_4seq_dt3)
timeout $((575 - SECONDS)) python3 -u -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py -k "two_gpus" 2>&1 \
  | tee $OUT/pytest_two_gpus.txt | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed" | tail -8
python3 -m suite table $D 2>&1 | tail -4
echo "done at $SECONDS s"
