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
# memory bandwidth are part of what it measures). Batches 3-6 are the h200 grid's, and `start 4 5 6`
# runs them in one detached run: the session's device time, not a batch's end, sets how far it goes,
# points already in the tree are not made again, each batch is one Snakemake in the order given
# (session 33: 3's point, then 4's), and each takes its points in the grid's order. Batch 9 is
# h200-scale's ($S) and runs alone (10, FSDP2's accumulation A/B, ran in session 36). A
# `start` is alone in its call: it returns 540 s after its own
# start, the wheels' install and the tree's copy included, and packs; anything before it in the
# call would take the call past its 10-minute limit, and that call's pack would never come back
# (session 27).
# Estimated walls (results/h200/README.md, "What is left"): batches 3-5 made (sessions 33-37);
# 6 about 20 minutes (its predictions below), so `start 6` and two attaches; 9 about 10.
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
B6="$R/ratel/7b_ratel_cpu.json $R/ratel/7b_ratel.json"
case $1 in
  start)  # start N [M ...]: batches 3-6 (the h200 grid's) in one detached run; 9 alone
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
      for n in "${@:2}"; do case $n in 3|4|5|6) ;; *) echo "batches 3-6 chain; 9 runs alone"; exit 1 ;; esac; done
      T=$(shift; for n in "$@"; do v=B$n; echo ${!v} | tr ' ' '\n' | paste -sd, -; done)
      # Batch 6, Ratel at the 7B shape (its GPT: 4.88 B parameters). Session 37 ran the disk route
      # (7b_ratel) and lost it to a late attach: its forward took 7.4 s, and its first backward had not
      # ended 12 minutes in (no step; the 1B disk point moves about 20 GB each way a step at about
      # 1.1 GB/s, the 7B about 85, so about 80 s). It is stale (its result is from before the checkout
      # was carried) and runs again with a 600 s limit. First, 7b_ratel_cpu, Ratel's host-memory route.
      # Predictions: 7b_ratel_cpu ok, 148 GiB of host by baselines/ratel_memory.py (admitted at 250),
      # 6-15 s a step, 40-120 model TFLOP/s (its 1B point 31.6 at an eighth of the tokens a step; the
      # paper's Ratel, from its NVMe RAID, 2.0-10.9), about 8 minutes with its op build; 7b_ratel a
      # timeout with 0 of 4 steps, about 11 minutes.
      if [ "${*:2}" = 6 ]; then
        # Before them (about 100 s): is this disk's rate sustained? 80 GiB written and read back with
        # O_DIRECT, dd's progress every second. Prediction: if the 7B's stall is the disk's, the write
        # rate falls from about 1.4 GB/s to under 0.2 after some tens of GB; if it holds, the stall is
        # Ratel's at this size and not the disk's.
        f=/tmp/disk_sustained.bin
        { timeout 150 dd if=/dev/zero of=$f bs=64M count=1280 oflag=direct status=progress
          timeout 90 dd if=$f of=/dev/null bs=64M iflag=direct status=progress; } 2>&1 | tr '\r' '\n' > $OUT/disk_sustained.txt
        rm -f $f; grep copied $OUT/disk_sustained.txt | awk 'NR % 10 == 0 || /[0-9][.][0-9]+ s,/'
      fi
      rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h200.yaml)
    fi
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h200 $T 2>&1 | tail -40 ;;
  attach)  # the detached run's table is printed by workflow_gpu.sh
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h200 2>&1 | tail -40 ;;
esac
