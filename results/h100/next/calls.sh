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
# 3. `gemini [V ...]` (a call of its own, no points; about 3 minutes a Gemini variant, the first with
#    HybridAdam's kernel build, under a minute for native: `gemini a e f` fills the call's 585 s,
#    `gemini c d b` the rest): why Gemini's loss goes NaN. Measured: at the 3B shape with 8 x 4096
#    here (session 9), NaN from the second step, while 4-7 x 4096 trained; on an H200 with one
#    8192-token sequence (h200x4 `devices`, sessions 31-32) NaN at 3B, 7B and 14B; before it, at 7B,
#    its losses tracked ZeRO-3 Offload's on the same data (12.644, 12.669 against 12.633, 12.663).
#    Two-step runs at the 3B shape, the point's tokens: (a) the point itself, again;
#    (e) Gemini's gradient reduce on the compute stream (`enable_async_reduce=false`); (f) PyTorch
#    native on the same data, the reference losses; (c) 2 x 4096; (d) nothing offloaded; (b) the
#    embeddings untied.
#    Prediction (session 31, from reading colossalai 0.5.0, not run): a race, not arithmetic. With
#    one rank, the reduce on Gemini's own stream copies a chunk's gradients out of a block allocated
#    on the compute stream and frees that block with no `record_stream`, so the allocator may hand it
#    to the compute stream's next tensor before the copy has read it. Then (a) NaN again; (e)
#    finite, with its second loss within 0.02 of (f)'s (bf16 against native's autocast); (c), (d) and (b)
#    either way (they move the allocator's layout, not the race). If (e) is NaN too, the race is not
#    it.
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
    declare -A how=([a]="gemini 8192 1" [e]="gemini 8192 1 enable_async_reduce=false" [f]="native 8192 1"
                    [b]="gemini 8192 1 --override=tie_word_embeddings=false" [c]="gemini 4096 2"
                    [d]="gemini 8192 1 offload_optim_frac=0 offload_param_frac=0")
    for v in ${@:2}; do [ -n "${how[$v]:-}" ] || { echo "variants: a e f c d b"; exit 1; }; done
    for v in ${@:2}; do
      [ $SECONDS -lt 400 ] || { echo "$v: not started (the call's time)"; continue; }
      read system seq batch extra <<< "${how[$v]}"
      timeout $(( 585 - SECONDS )) python3 -m suite run --system $system --preset qwen2.5-3b --seq $seq --batch $batch --accum 1 \
        --steps 2 --warmup 0 --timeout 600 $extra --out $OUT/gemini/$v.json > $OUT/gemini/$v.log 2>&1
      grep "$system step" $OUT/gemini/$v.log | sed "s/^/$v: /"
    done
    python3 -m suite table $OUT/gemini; exit 0 ;;
  attach)
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h100 2>&1 | tail -30 ;;
esac
