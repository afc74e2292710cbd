#!/usr/bin/env bash
# The calls on `nvidia-h200-x2` that finish the h200 grid (results/h200/README.md, "what is left"),
# carrying [".whl", ".libaio", ".ratel"]:
#   C=<commit> bash results/h200/next/x2_calls.sh start N [M ...]   then within 30 s of each reply:
#   bash results/h200/next/x2_calls.sh attach [SECONDS]       (at once: the machine goes back 30 s after a
#                                                             reply, and in session 37 a run was lost while its
#                                                             reply was read; extract workflow.tgz after;
#                                                             SECONDS, default 550: less where device time is
#                                                             short, never more: in session 36 an attach of 580
#                                                             ran past the call's 600 s with only its log back,
#                                                             and `attach 1` then packed in 16 s; the pack now
#                                                             comes before the table)
# One GPU a point (the profile's `host` resource runs one at a time: each run's CPU AdamW and host
# memory bandwidth are part of what it measures). Batches 3-7 are the h200 grid's, and `start 4 5 6`
# runs them in one detached run: the session's device time, not a batch's end, sets how far it goes,
# points already in the tree are not made again, each batch is one Snakemake in the order given
# (session 33: 3's point, then 4's), and each takes its points in the grid's order. Batch 9 is
# h200-scale's ($S) and runs alone (10, FSDP2's accumulation A/B, ran in session 36). A
# `start` is alone in its call: it returns 540 s after its own
# start, the wheels' install and the tree's copy included, and packs; anything before it in the
# call would take the call past its 10-minute limit, and that call's pack would never come back
# (session 27).
# Estimated walls (results/h200/README.md, "What is left"): batches 3-5 made (sessions 33-37);
# 6 about 16 minutes with its probe (its predictions below), so `start 6` and one attach; 7 about
# 11; 9 about 10.
# The carried folders are git-ignored and a new checkout lacks them: `.whl` from the workshop's
# device-wheels script, `.libaio` by `baselines/libaio.sh fetch .libaio` (ZeRO-Infinity, Ratel),
# `.ratel/LoHan` from RC4ML/LoHan (experiments/ratel_gpu.sh).
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri RATEL_HOME=$PWD/.ratel/LoHan \
  MEGATRAIN_HOST_MEMORY_GB=250
S="--config grid=workflows/grids/h200-scale.yaml"
R=results/h200/points
B3="$R/context/ctx256k.json"
B4="$R/depth/L28_megatrain.json $R/depth/L42_megatrain.json $R/depth/L56_megatrain.json $R/scale/14b_megatrain.json
    $R/scale/7b_native.json $R/scale/7b_zero3.json $R/depth/L28_zero3.json $R/depth/L28_fsdp2.json"
B5="$R/width/w1.0_zero3.json $R/width/w1.0_fsdp2.json $R/width/w1.5_zero3.json $R/width/w1.5_fsdp2.json
    $R/width/w2.0_zero3.json $R/width/w2.0_fsdp2.json"
B6="$R/ratel/7b_ratel_cpu.json"
B7="$R/ratel/7b_ratel.json"
case $1 in
  start)  # start N [M ...]: batches 3-7 (the h200 grid's) in one detached run; 9 alone
    # the wheels once for the call, and workflow_gpu.sh is told not to install them again
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH WHEELS=none
    if [ "$2" = 9 ]; then
      # h200-scale's: Qwen3-30B-A3B on 24 layers with the lean experts (about 2 minutes; predicted in
      # the grid: about 296), then the gpus experiment's FSDP2 points again with `accumulate: auto`
      # (stale: made with FSDP2's own accumulation; prediction: 7b_g1 near depth L28's 321 model
      # TFLOP/s, 7b_g2 above its 320; about 4 minutes each)
      rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h200-scale.yaml)
      T="$R/moe/q30b_L24_lean_megatrain.json,$R/gpus/7b_g1_fsdp2.json,$R/gpus/7b_g2_fsdp2.json $S"
    else
      for n in "${@:2}"; do case $n in 3|4|5|6|7) ;; *) echo "batches 3-7 chain; 9 runs alone"; exit 1 ;; esac; done
      T=$(shift; for n in "$@"; do v=B$n; echo ${!v} | tr ' ' '\n' | paste -sd, -; done)
      # Batches 6 and 7, Ratel at the 7B shape (its GPT: 4.88 B parameters). Session 37 ran the disk
      # route (7b_ratel) and lost it to a late attach: its forward took 7.4 s, and its first backward
      # had not ended 12 minutes in (no step; by its bytes, 78 GB read and 68 written, about 80 s).
      # Batch 6: 7b_ratel_cpu, Ratel's host-memory route. Prediction: ok, 148 GiB of host by
      # baselines/ratel_memory.py (admitted at 250), 4-8 s a step, 105-210 model TFLOP/s (the suite
      # counts Ratel's own GPT, 12 h^2 a layer and no head: 8.5e14 FLOPs a step; about 3 s of fp16
      # compute with its recompute, 1.8 s of CPU Adam at the 1B point's 0.37 ns a parameter, 0.6 s of
      # copies, partly overlapped; the 1B point 31.6 at an eighth of the tokens; the paper's Ratel,
      # from its NVMe RAID, 2.0-10.9), about 8 minutes with its set-up. Batch 7: 7b_ratel, stale (its result is from before the
      # checkout was carried), with a 600 s limit; prediction: a timeout with no step, about 11 minutes.
      if [ "${*:2}" = 6 ]; then
        # Before it (at most 7.7 minutes, so that the call packs within its 10; the first run builds
        # Ratel's ops, about 100 s): why the 7B's backward stalls. Read from Ratel's code (results/h200/README.md, session 37): a run with more than two
        # optimizer sub-groups of 700 M hands each finished one to its optimizer process in the middle
        # of the backward, through queues whose feeder threads copy 2.9 GB buffers into shared
        # memory, while the main process swaps and releases the next group; the 1B's two sub-groups
        # are handed over only at the backward's end, and the 3B and 7B stalled. Ratel's GPT on 12
        # layers at the 1B's 4 x 1024 tokens (2.40 B, 4 sub-groups, hand-offs at layers 10, 5 and 0),
        # two iterations, with its optimizer in the main process (--is_mp 0), then run.sh's --is_mp 1.
        # Prediction: is_mp 0 steps, about 40-50 s a backward; is_mp 1 reaches no step in its 150 s,
        # its disk counters flat after set-up. If is_mp 1 steps too, the hand-off is not the cause,
        # and the token count is the next suspect.
        mkdir -p $OUT/ratel_probe && eval "$(baselines/libaio.sh env .libaio)"  # as workflow_gpu.sh does
        # the queues' shared memory lives in /dev/shm, sized from MemTotal when mounted (small at first here)
        (df -h /dev/shm /tmp; grep -E "MemTotal|Shmem:" /proc/meminfo) > $OUT/ratel_probe/shm.txt 2>&1
        for mp in 0:270 1:150; do
          timeout $(( ${mp#*:} + 30 )) python3 -m suite run --system ratel --preset qwen2.5-7b --layers 12 --seq 1024 \
            --batch 4 --accum 1 --steps 1 --warmup 1 --timeout ${mp#*:} approximate_model=true offload=disk \
            args.is_mp=${mp%:*} --out $OUT/ratel_probe/L12_mp${mp%:*}.json > $OUT/ratel_probe/L12_mp${mp%:*}.txt 2>&1
        done
        python3 -m suite table $OUT/ratel_probe
      fi
      rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h200.yaml)
    fi
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h200 $T 2>&1 | tail -40 ;;
  attach)  # the detached run's table is printed by workflow_gpu.sh
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h200 2>&1 | tail -40 ;;
esac
