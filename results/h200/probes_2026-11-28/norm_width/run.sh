#!/usr/bin/env bash
# Ran in session 47 on `nvidia-h200` (157 s wall), with lean_norm's kernel a row width (this commit's
# change, then uncommitted), carrying [".whl"]. The same layers' ceilings as step_kernels/ (72.1 ms
# lean, 90.1 library, at b6b33f4 on the same kind of machine) and the 7B layer's (487.7 model TFLOP/s at 2026-11-26's change to rows).
# Prediction: the lean layer 57-60 ms (the norms' kernels from about 19 ms to about 3: the layer probe's
# 58.9 of 2026-11-26, before the norms were given one form as rows), the library's about 75; the 7B
# layer, whose norms have one width, unchanged within 1%.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
timeout 120 python3 -m experiments.probes.layer_kernels --preset qwen3-30b-a3b --variants experts_lean_gate,experts_library \
  --backends '' --out $OUT/q30b.json 2>&1 | grep -v Warn | tail -6
timeout $((205 - SECONDS)) python3 -m experiments.probes.layer_kernels --preset qwen2.5-7b --variants both --backends '' \
  --out $OUT/7b.json 2>&1 | grep -v Warn | tail -4
