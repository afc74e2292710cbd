#!/usr/bin/env bash
# The calls on `nvidia-h200-x2` that made the h200 grid's last points (every batch is made: results/h200/README.md),
# carrying [".whl", ".libaio", ".ratel"]:
#   C=<commit> bash results/h200/next/x2_calls.sh lean          (a plain call: the lean experts' check)
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
# h200-scale's ($S) and runs alone (10, FSDP2's accumulation A/B, ran in session 36), as does 11;
# 12 and 13, h200-scale's too, chain with each other. A
# `start` is alone in its call: it returns 540 s after its own
# start, the wheels' install and the tree's copy included, and packs; anything before it in the
# call would take the call past its 10-minute limit, and that call's pack would never come back
# (session 27).
# Estimated walls (results/h200/README.md, "What is left"): batches 3-7 made (7's point: 483 s wall,
# within one `start 7`); 9 about 8 minutes (14b's FSDP2 points are host refusals); 11 about 4; `lean`
# about 5 and the timeline's GPU test, a call of its own; 12 about 13 (a start and an attach); 13 about 3 (`start 13 12`: both, with an attach).
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
B12="$R/gpus/7b_g1.json $R/gpus/7b_g2.json $R/gpus/14b_g1.json $R/gpus/14b_g2.json"
B13="$R/moe/q30b_L24_lean_megatrain.json"
case $1 in
  start)  # start N [M ...]: batches 3-7 (the h200 grid's) in one detached run; 9 alone
    # the wheels once for the call, and workflow_gpu.sh is told not to install them again
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH WHEELS=none
    if [ "$2" = 9 ]; then
      # h200-scale's gpus experiment's FSDP2 points again with `accumulate: auto` (stale: made with
      # FSDP2's own accumulation; prediction: 7b_g1 near depth L28's 321 model TFLOP/s, 7b_g2 above
      # its 320; about 4 minutes each). Their set-up: the baselines' model is now built without torch's
      # own init, which transformers' overwrites (baselines/hf.py; a third less time on the 2-core CPU
      # machine at 3B); 7B FSDP2 took 110-152 s of set-up on this host before, so about 80-120 s now
      rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h200-scale.yaml)
      T="$R/gpus/7b_g1_fsdp2.json,$R/gpus/7b_g2_fsdp2.json $S"
    elif [ "$2" = 12 ] || [ "$2" = 13 ]; then
      # h200-scale's points again, 12 and 13 alone or chained in one detached run (`start 13 12`: 13
      # first, the shorter), each with its prediction:
      # 12: the gpus experiment's MegaTrain points with the current kernels (made at de3abe9, before
      # the compiled kernels were the default: 407.9 / 801.8 at 7B, 411.7 / 811.1 at 14B, where the
      # four-GPU host's at later commits ran 13-15% faster; ../../h200x4/compare_h200.txt).
      # Prediction: 7b_g1 about 460 model TFLOP/s, 14b_g1 about 470, the two-GPU points about 1.97x
      # them; about 13 minutes of points (walls 107, 156, 190 and 296 s before), so an attach follows.
      # 13: the lean-experts point with the norms' kernel a row width (made at 84a6737, when one
      # kernel built at the hidden size ran Qwen3's 128-wide head norms: 245.4 model TFLOP/s, 7.95 s;
      # the layer's ceiling since 72.1 -> 58.1 ms, ../probes_2026-11-28/norm_width). Prediction:
      # 285-300 model TFLOP/s (the ceiling's 306 at 0.93-0.98), 6.5-6.9 s a step, about 3 minutes
      for n in "${@:2}"; do case $n in 12|13) ;; *) echo "12 and 13 chain with each other only"; exit 1 ;; esac; done
      P=$(shift; for n in "$@"; do v=B$n; echo ${!v}; done)
      rm -f $P
      T="$(echo $P | tr ' ' '\n' | paste -sd, -) $S"
    elif [ "$2" = 11 ]; then
      # scale/7b_megatrain again with the current kernels, so that the scale figure's line joins one
      # setting (made at a4bc0bd: 409.2 model TFLOP/s, 15.17 s; the x4 host's at 5981b74: 444.1, 13.98).
      # Prediction: 435-445 model TFLOP/s, about 14.0 s a step, 3-4 minutes of wall
      rm -f $R/scale/7b_megatrain.json
      T=$R/scale/7b_megatrain.json
    else
      for n in "${@:2}"; do case $n in 3|4|5|6|7) ;; *) echo "batches 3-7 chain; 12 and 13 chain; 9 and 11 run alone"; exit 1 ;; esac; done
      T=$(shift; for n in "$@"; do v=B$n; echo ${!v} | tr ' ' '\n' | paste -sd, -; done)
      # Batch 7: 7b_ratel, Ratel's disk route at the 7B shape (its GPT: 4.88 B parameters) with
      # --is_mp 0 and 1 + 1 iterations (gh200.yaml says why), under a 900 s limit: made, 86.3 s an
      # iteration, 9.8 model TFLOP/s (results/h200/README.md)
      rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h200.yaml)
    fi
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h200 $T 2>&1 | tail -40 ;;
  lean)  # not detached, about 5 minutes: why the lean experts gave Qwen3-30B-A3B on 24 layers 245.4
    # model TFLOP/s where the layer probe's 302.0 predicted about 296 (results/h200/README.md). Its
    # GPU was busy 7.62 s a step against 7.92 with the library's experts: about 74 ms a layer pass
    # against the probe's 58.9. The same model on 6 layers at 8 x 4096 tokens, one micro-batch, each
    # expert kernel with the engine's trace; then the traced step's forward, recompute and backward
    # spans of each layer. Prediction: the lean layer's spans add up to about 74 ms (the library's about
    # 77), so the difference from the probe lies in the layer as the engine runs it; if they add
    # up to the probe's 59, the time is outside the layers' spans.
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    mkdir -p $OUT/lean
    for k in library lean; do
      python3 -m suite run --system megatrain --preset qwen3-30b-a3b --layers 6 --seq 4096 --batch 8 --accum 1 \
        --steps 2 --warmup 1 --timeout 240 engine.checkpoint_every=1 engine.experts_kernel=$k \
        trace=$OUT/lean/trace_$k.json --out $OUT/lean/q30b_L6_$k.json > $OUT/lean/q30b_L6_$k.txt 2>&1
    done
    python3 - $OUT/lean <<'PY'
import collections, json, pathlib, sys
# each layer's forward + recompute + backward (spans "forward L3" ...): a depth trend would say routing
for k in ("library", "lean"):
    f = pathlib.Path(sys.argv[1]) / f"trace_{k}.json"
    if not f.exists():
        print(k, "no trace")
        continue
    ms, kinds = collections.Counter(), collections.Counter()
    for e in json.loads(f.read_text())["traceEvents"]:
        if e.get("ph") == "X":
            kinds[e["cat"]] += e["dur"] / 1e3
            if e["cat"] in ("forward", "recompute", "backward"):
                ms[e["name"].split()[-1]] += e["dur"] / 1e3
    print(k, "ms by kind:", {c: round(v, 1) for c, v in sorted(kinds.items())})
    print(k, "ms a layer:", {layer: round(v, 1) for layer, v in sorted(ms.items(), key=lambda x: int(x[0][1:]))})
PY
    python3 -m suite table $OUT/lean
    # the timeline's breakdown and trace on the GPU (its per-step summary was changed on the CPU)
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k timeline 2>&1 | tail -3 | tee $OUT/lean/pytest_timeline.txt ;;
  attach)  # the detached run's table is printed by workflow_gpu.sh
    experiments/workflow_gpu.sh --attach $((${2:-550} - SECONDS)) h200 2>&1 | tail -40 ;;
esac
