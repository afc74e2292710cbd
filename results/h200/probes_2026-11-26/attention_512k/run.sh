#!/usr/bin/env bash
# One H200 (the one-GPU `nvidia-h200` counts half its time), carrying [".whl"], about 8 minutes:
#   C=<commit> bash results/h200/probes_2026-11-26/attention_512k/run.sh
# 1. pinned_cache.patch on this copy: a new run gives back the pinned host blocks torch's allocator
#    keeps cached after an earlier run in the process closed (its gradient slabs, its checkpoints'
#    host copies; the layer probe's trainers seemed to keep host memory, results/h200/README.md
#    session 25). Its test, then the one-GPU tests of the file with it. Prediction: all pass; the
#    closed run's cached bytes are above zero before and zero after.
# 2. The attention kernels at long context. Why: 7B at 1M tokens on all 28 layers (issue 25) is
# projected at about 33.5 minutes a step, beyond a lent machine's 30-minute hold; at 1M attention is
# about 94% of the step's executed FLOPs, so its kernel sets the step. The 7B layer's ceiling at 512K tokens (one sequence; one timed repetition
# after one warm-up, about 20 s each: the 28-layer step took 545.9 s) with torch's default SDPA
# backend, then flash and cuDNN alone, and the default's kernel breakdown.
# Prediction: at 4K tokens on the H100 the default ran at 424.8, cuDNN 419.0, flash 397.2 model
# TFLOP/s (results/h100/speed/kernels_2026-11-23), so the default is likely cuDNN already; at 512K
# the faster of flash and cuDNN is within 3% of the default, and attention is above 85% of the
# layer's device time. If flash or cuDNN alone beats the default by 10% or more, the engine should
# choose it at long context, and the 1M step's projection moves by as much.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
mkdir -p $OUT/probes
git apply results/h200/probes_2026-11-26/attention_512k/pinned_cache.patch
timeout 240 python3 -u -m pytest -v -rfE -p no:cacheprovider tests/test_gpu.py -k "not two_gpus" 2>&1 \
  | grep -v "^DEBUG" > $OUT/pytest_gpu_pinned_cache.txt
grep -E "gives_back|passed|failed" $OUT/pytest_gpu_pinned_cache.txt | tail -4
timeout $((580 - SECONDS)) python3 -m experiments.probes.layer_kernels --preset qwen2.5-7b --batch 1 --seq 524288 --reps 1 \
  --variants both --backends flash,cudnn --overrides '{"max_position_embeddings": 524288}' --out $OUT/probes/layer_7b_512k_attention.json 2>&1 | grep -v "Warning\|warn"
echo "done at $SECONDS s"
