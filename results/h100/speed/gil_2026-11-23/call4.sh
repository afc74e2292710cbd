#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
mkdir -p $OUT/new $OUT/ratel
A=$(python -m workflows.scripts.grid workflows/grids/h100-speed.yaml short_step/7b_4seq_auto | sed 's/ trace=[^ ]*//')
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c4 TRITON_CACHE_DIR=/tmp/tri_c4 MEGATRAIN_GIT_COMMIT=$C timeout 200 python -m suite run $A trace=$OUT/new/7b_4seq_auto.trace.json --out $OUT/new/7b_4seq_auto.json > $OUT/new/7b_4seq_auto.log 2>&1
echo "new/7b_4seq_auto rc $? at $SECONDS s"
eval "$(baselines/libaio.sh env .libaio)"
export RATEL_HOME=$PWD/.ratel/LoHan
for p in 1b_ratel_cpu 1b_ratel_disk; do
  left=$((585 - SECONDS)); [ $left -lt 90 ] && { echo "skip $p: $left s"; continue; }
  MEGATRAIN_GIT_COMMIT=$C timeout $left python -m suite run $(python -m workflows.scripts.grid workflows/grids/h100.yaml ratel/$p) --out $OUT/ratel/$p.json > $OUT/ratel/$p.log 2>&1
  echo "ratel/$p rc $? at $SECONDS s"
done
python -m suite table $OUT/new $OUT/ratel
