#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
mkdir -p $OUT/new $OUT/ratel
S=$(python -m workflows.scripts.grid workflows/grids/h100-speed.yaml short_step/7b_4seq_auto_slabs8 | sed 's/ trace=[^ ]*//; s/engine.device_tiles=auto/engine.device_tiles=15/')
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_c5 TRITON_CACHE_DIR=/tmp/tri_c5 MEGATRAIN_GIT_COMMIT=$C timeout 160 python -m suite run $S --steps 4 trace=$OUT/new/7b_4seq_dt15_slabs8.trace.json --out $OUT/new/7b_4seq_dt15_slabs8.json > $OUT/new/7b_4seq_dt15_slabs8.log 2>&1
echo "dt15 rc $? at $SECONDS s"
eval "$(baselines/libaio.sh env .libaio)"
export RATEL_HOME=$PWD/.ratel/LoHan PYTHONFAULTHANDLER=1
left=$((285 - SECONDS))
MEGATRAIN_GIT_COMMIT=$C timeout $left python -m suite run --system ratel --preset qwen2.5-0.5b --layers 2 --seq 256 --batch 4 --warmup 1 --steps 3 --timeout 240 approximate_model=true offload=cpu --out $OUT/ratel/smoke_cpu.json > $OUT/ratel/smoke_cpu.log 2>&1
echo "ratel rc $? at $SECONDS s"
python -m suite table $OUT/new
