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
# 3. `gemini` (a call of its own, about 9 minutes, no points): why Gemini's loss is NaN from its second
#    step at the 3B shape with one 8192-token sequence (h200x4 `devices/3b_gemini`, session 31) and at
#    8 x 4096 (here, session 9), while 4-7 x 4096 train and the 7B shape (untied embeddings) trains
#    at 1 x 8192. Four runs of two steps, the tokens of the grid's point: (a) the point itself,
#    again (is it repeatable?); (b) the embeddings untied; (c) 2 x 4096; (d) nothing offloaded.
#    Read: NaN in (a) but not (b): the tied embedding and lm_head under Gemini's chunks; NaN in (a)
#    but not (c): the sequence's length; not in (d): the CPU Adam's side. No prediction of which.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan
R=results/h100/points
case $1 in
  start)
    rm -f $R/ratel/3b_ratel.json $R/ratel/7b_ratel.json
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h100 $R/shared/3b_L8_native.json \
      $R/ratel/7b_ratel.json $R/ratel/3b_ratel.json 2>&1 | tail -30 ;;
  gemini)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site && mkdir -p $OUT/gemini
    for run in "a:8192:1:" "b:8192:1:--override=tie_word_embeddings=false" "c:4096:2:" "d:8192:1:offload_optim_frac=0 offload_param_frac=0"; do
      IFS=: read v seq batch extra <<< "$run"
      timeout $(( 585 - SECONDS )) python3 -m suite run --system gemini --preset qwen2.5-3b --seq $seq --batch $batch --accum 1 \
        --steps 2 --warmup 0 --timeout 600 $extra --out $OUT/gemini/$v.json > $OUT/gemini/$v.log 2>&1
      grep "gemini step" $OUT/gemini/$v.log | sed "s/^/$v: /"
    done
    python3 -m suite table $OUT/gemini; exit 0 ;;
  attach)
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h100 2>&1 | tail -30 ;;
esac
