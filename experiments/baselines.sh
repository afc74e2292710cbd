#!/usr/bin/env bash
# Every system on the GPU machine: the loss-tracking check on a tiny model, then named points.
#   OUT=results/h100/baselines experiments/baselines.sh [GROUP|POINT ...]   (default: baselines3b baselines7b)
# Carried here (git-ignored): .whl (deepspeed, colossalai and what the image lacks; built with
# ../shared/tools/device-wheels.sh and baselines/gemini.md) and .libaio (baselines/libaio.sh fetch).
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
[ $# -gt 0 ] || set -- baselines3b baselines7b
experiments/points.sh "$@"
