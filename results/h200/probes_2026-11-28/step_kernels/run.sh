#!/usr/bin/env bash
# Ran in session 47 at b6b33f4 on `nvidia-h200` (355 s wall; its outputs beside it: the library's
# 6-layer JSON and log did not come back, its table in library.txt did; results/h200/README.md says
# what it found). The lean experts' extra 20 ms a layer in the engine's step (results/h200/README.md, session 46), on
# one H200 (any host: a one-GPU `nvidia-h200` counts half its time), carrying [".whl"]:
#   C=<commit> bash results/h200/next/step_kernels.sh
# Qwen3-30B-A3B at 3 and 6 layers, 8 x 4096 tokens, one micro-batch, K = 1, with the lean experts and
# with the library's, one process each (experiments/probes/step_kernels.py; about a minute each, the
# 6-layer build about 90 GiB of host), then the per-layer table of each.
# Prediction (session 46, after reading its trace, results/h200/README.md): with the lean experts
# the spans about 78 ms a layer added and the ceiling about 59; the step's kernels a layer added
# about 78 too (within 10%), not the ceiling's: the kernels themselves run slower in the step, and
# the two top-kernel lists say which. In the trace the host issued recompute L5 to backward L4
# 100-150 ms before the GPU ran them, and those spans are as long as every other layer's, so the GPU
# was not waiting on launches. If the kernels are near the ceiling's instead, the time is between
# them inside the spans (a wait on another stream's event).
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
o=$OUT/step_kernels && mkdir -p $o
for k in lean library; do
  for L in 3 6; do
    timeout $((570 - SECONDS)) python3 -m experiments.probes.step_kernels --preset qwen3-30b-a3b --layers $L \
      --engine "{\"experts_kernel\": \"$k\"}" --out $o/${k}_L$L.json > $o/${k}_L$L.log 2>&1
    echo "$k L$L: exit $? at $SECONDS s; $(tail -n 1 $o/${k}_L$L.log)"
  done
  python3 -m experiments.probes.step_kernels --compare $o/${k}_L3.json $o/${k}_L6.json | tee $o/${k}.txt
done
