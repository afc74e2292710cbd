#!/usr/bin/env bash
# The call on `nvidia-h100-x1` (its held time counted at half) that completes the H100 grid's shared
# points and redoes its two stale Ratel points, carrying [".whl", ".libaio", ".ratel"]:
#   C=<commit> bash results/h100/next/calls.sh start        then, if its table shows a point left,
#   bash results/h100/next/calls.sh attach [SECONDS]        within 30 s (extract the reply's workflow.tgz first)
# 1. shared/3b_L8_native: PyTorch native on the shared set (session 10's JSON did not come back), so
#    that `python -m suite compare results/h100/points results/h200/points` pairs all three shared
#    points. About a minute (the H200's: 43 s wall).
# 2. ratel/3b_ratel and ratel/7b_ratel: stale (run without a checkout, before the grid gave them
#    `approximate_model` and the disk route), removed in the device's copy and run again.
#    Predictions (session 30):
#    - 7B is refused by its disk admission in seconds: 81.8 + 2 GiB of swap, against the 63.9 GiB
#      this host's /tmp had free when ZeRO-Infinity's 7B point was refused.
#    - 3B is admitted: 35.7 + 2 GiB of disk, 96.5 GiB of host by baselines/ratel_memory.py (of about
#      120 available). It is bound by the disk, as the 1B point was here (16.7 s backward; on the x2
#      host the same point moved about 41 GB a step): about 76 GB a step (17-18 B per parameter of
#      Ratel's 2.13 B each way), so 30-35 s a step and 5-6 model TFLOP/s. Host peak as the harness counts it about 115 GiB (the
#      optimizer process's shared buffers twice). About 5 minutes with Ratel's op build.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan
R=results/h100/points
case $1 in
  start)
    rm -f $R/ratel/3b_ratel.json $R/ratel/7b_ratel.json
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h100 $R/shared/3b_L8_native.json \
      $R/ratel/7b_ratel.json $R/ratel/3b_ratel.json 2>&1 | tail -30 ;;
  attach)
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h100 2>&1 | tail -30 ;;
esac
