#!/usr/bin/env bash
# The calls on `nvidia-h200-x2` that finish the h200 grid (results/h200/README.md, "what is left"),
# carrying [".whl", ".libaio", ".ratel"]:
#   C=<commit> bash results/h200/next/x2_calls.sh start N [M ...]   then within 30 s of each reply:
#   bash results/h200/next/x2_calls.sh attach [SECONDS]       (extract each reply's workflow.tgz first;
#                                                             SECONDS, default 550: less where device time is short)
# One GPU a point (the profile's `host` resource runs one at a time: each run's CPU AdamW and host
# memory bandwidth are part of what it measures). Batches 2-5 are the h200 grid's, and `start 2 3 4 5`
# runs them in that order in one detached run: the session's device time, not a batch's end, sets
# how far it goes, and points already in the tree are not made again. Batch 9 is h200-scale's ($S)
# and runs alone. A `start` is alone in its call: it returns 540 s after its own start, the wheels'
# install and the tree's copy included, and packs; anything before it in the call would take the
# call past its 10-minute limit, and that call's pack would never come back (session 27).
# Estimated walls (results/h200/README.md's table): what is left of batch 2 about 6 minutes (three
# ablations, Ratel's 14B and 32B refusals run again), 3 about 20, 4 about 37, 5 about 27; 9 about 2.
# The carried folders are git-ignored and a new checkout lacks them: `.whl` from the workshop's
# device-wheels script, `.libaio` by `baselines/libaio.sh fetch .libaio` (ZeRO-Infinity, Ratel),
# `.ratel/LoHan` from RC4ML/LoHan (experiments/ratel_gpu.sh).
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan \
  MEGATRAIN_HOST_MEMORY_GB=250
S="--config grid=workflows/grids/h200-scale.yaml"
R=results/h200/points
B2="$R/ablations/sync_grads.json $R/ablations/K1.json $R/ablations/K1_b96.json $R/ratel/14b_ratel.json $R/ratel/32b_ratel.json"
B3="$R/context/ctx1k.json $R/context/ctx8k.json $R/context/ctx32k.json $R/context/ctx128k.json $R/context/ctx256k.json"
B4="$R/depth/L28_megatrain.json $R/depth/L42_megatrain.json $R/depth/L56_megatrain.json $R/scale/14b_megatrain.json
    $R/scale/7b_native.json $R/scale/7b_zero3.json $R/depth/L28_zero3.json $R/depth/L28_fsdp2.json"
B5="$R/width/w1.0_zero3.json $R/width/w1.0_fsdp2.json $R/width/w1.5_zero3.json $R/width/w1.5_fsdp2.json
    $R/width/w2.0_zero3.json $R/width/w2.0_fsdp2.json"
case $1 in
  start)  # start N [M ...]: batches 2-5 (the h200 grid's) one after another in one detached run; 9 alone
    if [ "$2" = 9 ]; then
      # Qwen3-30B-A3B on 24 layers with the lean experts (about 2 minutes; predicted in the grid: about 296)
      T="$R/moe/q30b_L24_lean_megatrain.json $S"
    else
      for n in "${@:2}"; do case $n in 2|3|4|5) ;; *) echo "batches 2-5 chain; 9 runs alone"; exit 1 ;; esac; done
      T=$(shift; for n in "$@"; do v=B$n; echo ${!v} | tr ' ' '\n' | paste -sd, -; done)
      case " ${*:2} " in *" 2 "*)
        # Ratel's disk route, why it reached no step in 560 s here (session 29; the H100 host's run
        # stepped in 17.5 s): the same spec for 300 s, past Ratel's op builds (about 100 s on a
        # fresh machine), its set-up (70 s) and forward, about 110 s into its first backward; then
        # the runner's stacks (now Ratel's processes' too, with each thread's
        # wait in the kernel) and the host's disk traffic over the run. Prediction: disk-bound, its
        # threads waiting on the disk (io_getevents or state D) and disk_io at about this disk's
        # 1.4 GB/s write and 2.4 read over the backward; a hang instead shows futex waits and little
        # disk traffic. About 330 s with the wheels' install, off this call's detached wait.
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
          && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH WHEELS=none
        ( eval "$(baselines/libaio.sh env .libaio)"
          timeout 360 python3 -m suite run --system ratel --preset qwen2.5-7b --layers 4 --seq 1024 --batch 4 \
            --accum 1 --warmup 1 --steps 3 --timeout 300 --out "${OUT:-/tmp}/ratel_disk_probe.json" \
            approximate_model=true offload=disk > "${OUT:-/tmp}/ratel_disk_probe.txt" 2>&1 )
        python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['status'], r.get('disk_io')); print(r.get('stacks', '')[-3000:])" \
          "${OUT:-/tmp}/ratel_disk_probe.json" | tail -40
        rm -rf /tmp/ratel-*  # the killed run's swap files (its own clean-up did not run)
        # 14B and 32B ran before this host had a Ratel checkout, and their reason says so; with it, the
        # disk admission refuses them in seconds (266.6 and 351.0 GiB of swap at 18 B/param, 127.8 free).
        # Not 7B: with the checkout it is admitted (81.8 GiB) and would run up to its 3600 s timeout
        rm -f $R/ratel/14b_ratel.json $R/ratel/32b_ratel.json ;;
      esac
    fi
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h200 $T 2>&1 | tail -40 ;;
  attach)  # the detached run's table is printed by workflow_gpu.sh
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h200 2>&1 | tail -40 ;;
esac
