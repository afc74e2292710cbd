#!/usr/bin/env bash
# The calls on `nvidia-h100-x1` (its held time counted at half), carrying [".whl", ".libaio", ".ratel"]:
#   C=<commit> bash results/h100/next/calls.sh start        then, if its table shows a point left,
#   bash results/h100/next/calls.sh attach [SECONDS]        within 30 s (extract the reply's workflow.tgz first)
# Session 33 made the shared native point and Ratel's 3B (timeout) and 7B (refused by the disk), and
# ran `gemini a e f` (../README.md).
# 1. `start`: every h100 grid point without a result (the width baselines from 1.5x, the devices
#    experiment), its stale results removed in the device's copy first. Most are refused by
#    admission in seconds on this 126 GiB host (ZeRO-3 Offload at 7B needs 221 GiB); the run detaches
#    and each later `start` goes on where it stopped.
# 2. `gemini [V ...]` (a call of its own, no points; about 3 minutes a Gemini variant, the first with
#    HybridAdam's kernel build, under a minute for native), two-step runs at the 3B shape:
#    (a) 8192 tokens with ColossalAI's asynchronous reduce (NaN at step 2, session 33); (e) the same
#    with the suite's default, the reduce on the compute stream (trained, session 33); (f) PyTorch
#    native on the same data; (g) 8 x 4096 with the suite's default: `baselines/3b_gemini_b8`'s shape,
#    NaN twice with ColossalAI's default. Prediction for (g): finite losses, about 9-10 s a step
#    (the 7-sequence point's 9.0 s, one sequence more); (c) 2 x 4096, (d) nothing offloaded and (b)
#    the embeddings untied, with ColossalAI's default, are kept for a question (e) left open.
#    (h) is (e) with glibc's mmap off (MALLOC_MMAP_MAX_=0, the freed heap kept): HybridAdam's update of
#    bf16 gradients is torch ops whose temporaries (12 B a parameter, 37 GB a step at 3B) are mapped
#    and faulted in afresh at every step (../../cpu-bench/README.md: 60% of that update on 2 cores).
#    Run `gemini e h g`, (e) again beside it. Prediction: (h) about 6-7 s a step against (e)'s 9.57
#    (session 33), its losses within 0.001 of (e)'s (the same ops on the same data).
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan
R=results/h100/points
case $1 in
  start)
    rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h100.yaml)
    T=$(for p in $(python3 -m workflows.scripts.grid workflows/grids/h100.yaml); do
          [ -f $R/$p.json ] || echo $R/$p.json; done)
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h100 $T 2>&1 | tail -30 ;;
  gemini)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site && mkdir -p $OUT/gemini
    A=enable_async_reduce=true
    declare -A how=([a]="gemini 8192 1 $A" [e]="gemini 8192 1" [f]="native 8192 1" [g]="gemini 4096 8"
                    [b]="gemini 8192 1 $A --override=tie_word_embeddings=false" [c]="gemini 4096 2 $A"
                    [d]="gemini 8192 1 $A offload_optim_frac=0 offload_param_frac=0")
    how[h]=${how[e]}
    declare -A envs=([h]="MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736")
    for v in ${@:2}; do [ -n "${how[$v]:-}" ] || { echo "variants: a e f g c d b h"; exit 1; }; done
    for v in ${@:2}; do
      [ $SECONDS -lt 400 ] || { echo "$v: not started (the call's time)"; continue; }
      read system seq batch extra <<< "${how[$v]}"
      env ${envs[$v]:-} timeout $(( 585 - SECONDS )) python3 -m suite run --system $system --preset qwen2.5-3b --seq $seq --batch $batch --accum 1 \
        --steps 2 --warmup 0 --timeout 600 $extra --out $OUT/gemini/$v.json > $OUT/gemini/$v.txt 2>&1
      grep "$system step" $OUT/gemini/$v.txt | sed "s/^/$v: /"
    done
    python3 -m suite table $OUT/gemini; exit 0 ;;
  attach)
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h100 2>&1 | tail -30 ;;
esac
