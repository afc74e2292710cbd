#!/usr/bin/env bash
# Prepared in sessions 21-23 for the next `nvidia-h200-x4` calls, carrying [".whl"]:
#   C=<commit> [DEADLINE=S] bash results/h200x4/next/calls.sh start N    then, where a batch detaches, within 30 s of each reply:
#   bash results/h200x4/next/calls.sh attach [SECONDS]      (extract each reply's workflow.tgz first; default 540)
#   PATH=$PWD/.venv/bin:$PATH bash results/h200x4/next/calls.sh plan   here, on the CPU machine, before `start grid`
# Batches 1 and 3 ran in sessions 22 and 23, batch 2's probes in session 23 (`../README.md`):
# 2 (one call, no points, about 4 minutes): the split masters' update rate by thread count; the
#   vector-ISA check, inductor's way and the engine's.
# 4 (one call, no points, about 9 minutes): A/Bs of the pending fill patch and of the optimizer's
#   threads per rank at 4 GPUs.
# 5 (about 4 minutes, detached): the three points every machine's grid shares.
# 6 (about 8 minutes, detached): the whole MoE models with the lean experts.
# 7 (about 6 minutes, detached): 7B at 1M tokens on 4 layers; made in session 40 (`../README.md`).
# 8 (one call, no points, about 8 minutes): Gemini's CPU update on this host, first in the next session.
# 9 (about 4 minutes, detached): FSDP2's 4-GPU point again with its micro-batches summed on the GPUs.
# grid (detached, attached until the session's device time ends; each later session starts it again
#   (LONG_FIRST=0 to `plan` in a session that has spent part of its device time before it: below)
#   and the points made are skipped): every point of the h200x4 grid without a result, the short
#   ones one snakemake for up to 1200 s of their estimates, each with its estimate for DEADLINE
#   (below), as `plan` listed them here (results/h200x4/next/grid.plan, carried), the cheapest
#   experiments first (../README.md's estimate: shared 4, ablations 17, context 24, devices 52,
#   scale 58, depth 84, width 92 device minutes at the old 5 + 2 steps).
#   Sessions 28, 31 and 32 made shared, ablations, context, devices and one scale point, session 34
#   devices' four Gemini points again, session 39 scale's 7B baselines and 14B MegaTrain, sessions 40
#   and 41 the other 14B points and width's w1.0_fsdp2, session 42 width's w4.0_fsdp2 and scale's
#   32B FSDP2 and ZeRO-Infinity (refused), session 43 17 points (32B MegaTrain, depth's L28 and L42
#   MegaTrain, width's w1.0 MegaTrain, 13 refusals) and the bandwidth probe, session 44 depth's L84
#   FSDP2 and L42 ZeRO-3 and width's w1.5 MegaTrain, session 45 scale's ZeRO-Infinity 7B (the last of
#   scale), depth's L42 FSDP2 and width's w2.0 MegaTrain; 23 are left (depth 6, width 17).
#   Only the missing points are named.
#   Ask for the call with needs_h200 (session 31: an H200 host came at once).
#   Carry [".whl", ".libaio", "results/h200x4/next/grid.plan"]: ZeRO-Infinity needs libaio, and the devices experiment's Gemini needs
#   colossalai 0.5.0, galore-torch 1.0 and bitsandbytes 0.50.2 in .whl (baselines/gemini.md); the
#   bitsandbytes wheel there is repacked with only its CUDA 13.0 and CPU libraries (3.9 MB, not 43),
#   so that the tree and its carried folders stay within a call's 64 MiB: unzip it, delete the other
#   bitsandbytes/libbitsandbytes_*.so and their lines in the dist-info's RECORD, zip it again.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
G="--config grid=workflows/grids/h200x4-scale.yaml"
R=results/h200x4/points
PLAN=results/h200x4/next/grid.plan
case $1 in
  start)
    # this grid is sized for H200s; a call that comes on H100s stops here
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { nvidia-smi -L; echo "not an H200 host: nothing run"; exit 3; }
    # the wheels once for the call (workflow_gpu.sh is told not to install them again)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH WHEELS=none MEGATRAIN_HOST_MEMORY_GB=500
    case $2 in
      2) # two probes, about 3.5 minutes (the router loss over the ranks, once part of this call, landed
         # after its two-GPU check on the x2 host in session 25)
         # the split masters' update against the whole masters' at 16, 32 and 64 threads (about two minutes):
         # on this host the 120B shape's and the 88-layer model's split updates ran at 0.54-0.65 ns a
         # parameter, the whole masters' at 0.14-0.21 (a quarter; 0.41 on the 2-core CPU machine, 0.52 on
         # the x2 host). Prediction: the split update stops scaling well before 64 threads, the whole
         # one does not; if both scale alike, the steps' split rate is not the kernel's and the probe says so.
         for t in 16 32 64; do for v in "SPLIT=0 COMPILED=0" "SPLIT=1 COMPILED=0"; do
           env $v T=$t PYTHONPATH=. timeout 60 python3 experiments/probes/adamw_rate.py 134217728 4 "$v T=$t" | tee -a $OUT/adamw_split_rate.txt
         done; done
         # inductor's check of the vector instruction sets, its own way (one set after another: 27.5-28.8 s
         # here in session 23) against the engine's (kernel_build.check_vector_isas: every set's at once;
         # 13.0-13.4 -> 7.9-8.0 s on the 2-core CPU machine with torch 2.11). Prediction: about 28 -> 8 s,
         # one set's build and fresh `import torch` (10 s here) instead of four.
         for c in inductor engine inductor engine; do
           ISA_CHECK=$c CUDA=1 timeout 90 python3 -m experiments.probes.adamw_build | tee -a $OUT/adamw_build.jsonl
         done
         exit 0 ;;
      4) # Two A/Bs at 7B on 4 GPUs, three runs, about 9 minutes, each with its last step's timeline.
         # (a) main: the first run on this machine makes the check of the CPU's vector instruction sets
         # (every set's at once, 14-22 s a point in session 28) and keeps its answer beside inductor's
         # cache; (b) with fill_cores.patch on this copy: the rank that fills the shared store takes the
         # waiting ranks' cores. Predictions: setup_s.vector_isas about 15 s in (a), under 0.5 s in (b)
         # and (c) (the kept answers, every check's replayed), and setup_s.optimizer_kernel under 5 s there; setup_s.fill 24 -> about 10 s in (b) (one rank's fill at 7B with
         # 64 cores instead of 16); the step unchanged. (c) the patch and 14 optimizer threads
         # a rank instead of 16: the GPU idled 0.25-0.51 s a step while 4 ranks issued work (0.03 with
         # one), reduce_s now timed apart; prediction: with 2 of each rank's cores left to its main and
         # NCCL threads the idle beside reduce_s falls below 0.1 s and 4 GPUs reach about 3.95x one
         # (3.885 measured), the AdamW (1.25 s busy of a 6.8 s step) still hidden.
         mkdir -p $OUT/ab && for run in a:16 b:16 c:14; do
           v=${run%:*} t=${run#*:}
           [ $v = b ] && git apply results/h200x4/next/fill_cores.patch
           timeout $(( 585 - SECONDS )) python3 -m suite run --system megatrain --preset qwen2.5-7b --seq 4096 --batch 32 --accum 2 --steps 5 \
             --warmup 2 --timeout 900 --gpus 4 engine.checkpoint_every=1 engine.optimizer_threads=$t trace=$OUT/ab/7b_g4_$v.trace.json \
             --out $OUT/ab/7b_g4_$v.json > $OUT/ab/7b_g4_$v.log 2>&1
         done
         git apply -R results/h200x4/next/fill_cores.patch
         python3 -m suite table $OUT/ab; exit 0 ;;
      5) # the points every machine's grid shares (issue 25: compared with the other machines), about 4 minutes
         G="" T="$R/shared/3b_L8_megatrain.json $R/shared/3b_L8_megatrain_K1.json $R/shared/3b_L8_native.json" ;;
      6) # the whole Qwen3-30B-A3B and GPT-OSS-20B with the lean experts (predicted in the grid: about 296 and
         # 286 model TFLOP/s against the library's 233.9 and 199.6), about 4 minutes each
         T="$R/moe/q30b_lean_megatrain.json $R/moe/oss20b_lean_megatrain.json" ;;
      7) # 7B at 1M tokens on 4 of its 28 layers (about 6 minutes; predicted in the grid: about 294 s a step)
         T="$R/long_context/ctx1m_L4.json" ;;
      9) # FSDP2 on 4 GPUs again with `accumulate: auto` (stale: session 22's 859.0 model TFLOP/s summed
         # through the host); each rank sums on its GPU (92.6 GiB counted, 104.6 with the slack, of about
         # 139 free). Prediction: about 4x the one-GPU rate at 8 x 2 x 4096 (the x2 host's L28 at 8 x 4:
         # 321.2), 1100-1300 model TFLOP/s, about 4 minutes
         rm -f $(python3 -m workflows.scripts.grid --stale workflows/grids/h200x4-scale.yaml)
         T="$R/gpus/7b_g4_fsdp2.json" ;;
      8) # Gemini's CPU update. Session 34 on this host (torch's 64 threads, its default here):
         # 3B at one sequence of 8192, 15.5-21.9 s a step (median 19.7, 10.7 model TFLOP/s); the H100
         # machine's 16 cores, same spec, 8.7-10.4 s (22.2). ZeRO-3 Offload's C++ CPU Adam at 64 threads
         # is not slow here (3B 2.91 s). Gemini's bf16 gradients go to HybridAdam's update of torch ops,
         # whose temporaries (12 B a parameter, 37 GB a step at 3B) glibc mmaps afresh at every step:
         # 60% of that update's time on the 2-core CPU machine (../../cpu-bench/README.md). Three runs,
         # the same spec as devices/3b_gemini, each with the page faults of its process tree:
         # (a) 16 threads; (b) 64 threads, mmap off (MALLOC_MMAP_MAX_=0, the freed heap kept); (c) 64
         # threads as the grid ran it. Predictions: (c) about 20 s a step again; (b) at most 10 s, its
         # process tree's minor faults down by about 37 M over the four steps (37 GB of 4 KiB pages a
         # step), peak host within 5 GiB of (c)'s; (a) between, nearer (c) if the faults' cost is the
         # pages' zeroing and not the threads' contention. The first run builds ColossalAI's kernels
         # (about 100 s), kept for the others.
         (lscpu; uname -r) > $OUT/host.txt 2>&1
         for v in a:16: b:64:0 c:64:; do
           IFS=: read -r name t mmap <<< "$v"
           env OMP_NUM_THREADS=$t ${mmap:+MALLOC_MMAP_MAX_=$mmap MALLOC_TRIM_THRESHOLD_=68719476736} \
             timeout $(( 585 - SECONDS )) python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[1:]); print("minor faults", resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt); sys.exit(rc)' \
             python3 -m suite run --system gemini --preset qwen2.5-3b --seq 8192 --batch 1 --accum 1 --steps 3 --warmup 1 \
             --timeout 400 enable_async_reduce=false --out $OUT/3b_gemini_$name.json > $OUT/3b_gemini_$name.txt 2>&1
         done
         # (the worker writes its own log beside its result, 3b_gemini_$name.log)
         grep -H "minor faults" $OUT/*.txt; python3 -m suite table $OUT; exit 0 ;;
      grid) G=""
         # the targets as `plan` wrote them here on the CPU machine, less those made since
         [ -f $PLAN ] || { echo "no $PLAN: run 'calls.sh plan' on the CPU machine and carry it"; exit 2; }
         # the stale results, removed in the device's copy so that they run again (none since session 34)
         rm -f $(sed -n 's/^stale //p' $PLAN)
         T=$(sed -n 's/^target //p' $PLAN | while read -r t; do
               left=$(echo "$t" | tr , '\n' | while read -r m; do [ -f "${m%@*}" ] || echo "$m"; done | paste -sd,)
               [ -z "$left" ] || echo "$left"
             done) ;;
    esac
    [ -n "${DEADLINE:-}" ] && export DEADLINE=$((DEADLINE - SECONDS))  # in workflow_gpu.sh's own seconds
    experiments/workflow_gpu.sh --detach $((540 - SECONDS)) h200x4 $T $G 2>&1 | tail -40 ;;  # back 540 s after the call's start, then the table and the pack
  plan)
    # On the CPU machine, before a session's `start grid` (in .venv: PATH=$PWD/.venv/bin:$PATH): the
    # grid's targets in order, each with its estimate, and the stale results, into $PLAN, which the
    # call carries (git-ignored): the three listings take about 40 s of device time there (each a
    # Python that imports torch and transformers) and the same tree gives the same answer here.
    points=$(python3 -m workflows.scripts.grid workflows/grids/h200x4.yaml)
    points=$(for p in $points; do [ -f $R/$p.json ] || echo $p; done)
    # depth/L180_megatrain (43.0 B parameters) plans 491.4 GiB of host with split masters (`megatrain
    # plan`), the closest yet to this host's 503.8 GiB (the 12-layer GPT-OSS-120B shape ran at 479.0,
    # the 88-layer 32B at 469.7, each within 0.3% of its plan). Prediction: it trains, its host
    # peak within 0.5% of the plan; if the OOM killer stops it, its result says so (oom_host).
    # The long points, 15-20 minutes each: ZeRO-Infinity's 7B swaps about 400 GB a step to the VM's
    # disk (about 17 minutes at the H100 machine's disk rate, ../README.md; its larger ones are
    # refused by the disk), and FSDP2
    # sums its micro-batches on the host where their sum on the GPU does not fit (above about 15 B
    # parameters: w4.0 took 1397 s in session 42; L84, one measured step after two, is estimated
    # from it at about 20 minutes). A point the session's end cuts off is lost, so one long point
    # goes first, while a session's device time is whole, and the others after every short one:
    # the cut falls on a short point.
    long="width/w4.0_fsdp2 depth/L84_fsdp2 scale/7b_zero_infinity"
    first=$(for p in $long; do echo "$points" | grep -x "$p"; done | head -1)
    later=$(for p in $long; do echo "$points" | grep -x "$p"; done | tail -n +2)
    # LONG_FIRST=0: a session whose device time is partly spent already takes every long point last
    if [ "${LONG_FIRST:-1}" = 0 ]; then later=$(printf '%s\n%s\n' "$first" "$later" | sed '/^$/d'); first=""; fi
    rest=$(echo "$points" | grep -vxF "$(echo $long | tr ' ' '\n')")
    # every point its own target with its estimate (workflows/scripts/estimate.py), which DEADLINE
    # (seconds after this call's start at which the session's device time ends) holds back where
    # it would be cut off: session 41 lost its last point, 32B MegaTrain, to the end after 6 of
    # its 6.5 minutes. Unknown (no result of its system and summing here): a long point 1500 s
    # (ZeRO-Infinity's 7B), another 60 s. Each known one 1.25x and
    # 30 s more: the estimates of this host's 33 results from the others (`estimate --check`)
    # were 4% short at the median, and more than that margin short on 3 (-44 to -57%)
    # The points the estimate foresees refused by admission (50 s: estimate.REFUSAL_S and its
    # JOB_OVERHEAD_S) go as one group after the first, one snakemake for all: each apart took a
    # 40 s job and about 18 s more to start its snakemake (session 42's log), for a 22 s result.
    est=$(python3 -m workflows.scripts.estimate workflows/grids/h200x4.yaml 2>/dev/null)
    refused=$(echo "$rest" | while read -r p; do echo "$est" | awk -v p="$p" '$1 == p && $2 == 50 {print $1}'; done)
    target() {
      s=$(echo "$est" | awk -v p=$1 '$1 == p {print $2}')
      if [ "${s:--}" = - ]; then echo "$long" | grep -qw "$1" && s=1500 || s=60; else s=$((s * 5 / 4 + 30)); fi
      echo "$R/$1.json@$s"
    }
    T=$(for p in $first; do target $p; done
        # this host's bandwidth probe (Table 1 of the end-to-end run; its disk's rate foretells
        # ZeRO-Infinity's 7B), about a minute: the other hosts' 1 GiB a tier and 4 GiB of disk
        [ -f results/h200x4/probes/bandwidth.json ] || echo results/h200x4/probes/bandwidth.json@120
        [ -z "$refused" ] || for p in $refused; do echo $R/$p.json@50; done | paste -sd,
        # the short points in groups of up to 1200 s of estimates, each group one snakemake: each
        # snakemake took about 18 s to build its DAG (session 42's log): 28 of them for the 28 points
        # left after session 43; the run makes a group's members that end before the deadline
        for p in $(for e in shared ablations context devices scale depth width; do echo "$rest" | grep "^$e/"; done | grep -vxF "${refused:-^}"); do target $p; done |
          awk -F@ '{ if (n && sum + $2 > 1200) { print group; n = sum = 0 } group = (n ? group "," : "") $0; sum += $2; n++ } END { if (n) print group }'
        for p in $later; do target $p; done)
    { python3 -m workflows.scripts.grid --stale workflows/grids/h200x4.yaml | sed '/^$/d; s/^/stale /'
      for t in $T; do echo "target $t"; done; } > $PLAN
    grep -c '^target' $PLAN | sed "s|$| targets in $PLAN|" ;;
  attach)
    experiments/workflow_gpu.sh --attach ${2:-540} h200x4 2>&1 | tail -40 ;;
esac
