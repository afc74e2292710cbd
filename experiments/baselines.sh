#!/usr/bin/env bash
# Every system's loss-tracking check on the GPU machine (python -m suite check): each trains a tiny
# model from one saved random init on one fixed batch, its losses compared step by step with native's.
#   OUT=results/h100/probes/baselines experiments/baselines.sh      (CHECK_SYSTEMS: a comma-separated subset)
# Carried here (git-ignored): .whl and .libaio, as experiments/workflow_gpu.sh describes. The systems'
# measured points are workflow targets, e.g. on the H100 machine:
#   experiments/workflow_gpu.sh 540 h100 scale ratel          # every system at 4 sequences, 3B and 7B
#   experiments/workflow_gpu.sh 540 h100 batches --config grid=workflows/grids/h100-speed.yaml
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .libaio ] && eval "$(baselines/libaio.sh env .libaio)"
python3 -m suite check --systems "${CHECK_SYSTEMS:-megatrain,native,fsdp2,zero3,zero_infinity,gemini,ratel}" \
  --out-dir "$OUT/check" --timeout "${POINT_TIMEOUT:-600}"
