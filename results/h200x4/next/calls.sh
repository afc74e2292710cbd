#!/usr/bin/env bash
# Prepared in sessions 21-22 for the next `nvidia-h200-x4` calls, carrying [".whl"]:
#   C=<commit> bash results/h200x4/next/calls.sh start N    then, where a batch detaches, within 30 s of each reply:
#   bash results/h200x4/next/calls.sh attach                (extract each reply's workflow.tgz first)
# Batch 1 ran in session 22 (`../README.md`). Wall times are estimates from the session-21 and
# session-22 points and the 32B point of session 10 (set-up 280 s at 397 GB of host):
# 2 (one call, no points, up to 9 minutes): the pending MoE router loss over ranks on this copy only,
#   its 2-GPU checks; the compiled AdamW's build; two MoE layers' kernel breakdown at two micro-batches.
# 3 (about 20 minutes, detached): `moe/q30b_8k`, the GPT-OSS-120B shape on 12 layers, the 32B layer
#   at 88 layers (44.5 B).
# 4 (one call, no points, about 9 minutes): A/Bs of the pending set-up patch and of the optimizer's
#   threads per rank at 4 GPUs.
# 5 (about 4 minutes, detached): the three points every machine's grid shares.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
G="--config grid=workflows/grids/h200x4-scale.yaml"
R=results/h200x4/points
case $1 in
  start)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site MEGATRAIN_HOST_MEMORY_GB=500
    case $2 in
      2) # the pending change, applied to this copy for its checks and taken off again (about two minutes)
         git apply results/h200/next/moe_router_loss_over_ranks.patch
         timeout 180 python3 -u -m pytest -v -p no:cacheprovider --durations=0 -k two_gpus_track tests/test_gpu.py 2>&1 \
           | tee $OUT/pytest_moe_two_gpus.txt | tail -4
         git apply -R results/h200/next/moe_router_loss_over_ranks.patch
         # where the compiled AdamW's 35-55 s of set-up per point go (two minutes at most): cold and warm,
         # with the engine's C++ wrapper and without it (on the CPU machine a cold build took 11 s with it
         # and 3 s without; from the cache 2 s either way)
         for w in 1 1 0 0; do CUDA=1 WRAPPER=$w timeout 60 python3 -m experiments.probes.adamw_build | tee -a $OUT/adamw_build.jsonl; done
         # where an MoE layer's time goes (the H100's Qwen3-30B-A3B layer: 208 model TFLOP/s against a
         # dense layer's 470-490), by kernel kind, one layer resident, with the GPU's default kernels;
         # at the grid's micro-batch (8 x 4096) and at twice it. Prediction: the MoE layers at 8 x 4096
         # run at about half the dense layer's rate, as the whole-model steps did (200-234); at 16 x 4096
         # each expert's grouped GEMM has twice the rows (Qwen3-30B-A3B 2K -> 4K, GPT-OSS-20B 4K -> 8K),
         # which should lift the rate by 10-20%, more for Qwen3's 128 small experts than for GPT-OSS's 32.
         # Qwen3 first (no flex attention to build), then GPT-OSS (flex builds once; the second from cache).
         for mb in qwen3-30b-a3b:8 qwen3-30b-a3b:16 gpt-oss-20b:8 gpt-oss-20b:16; do
           m=${mb%:*} b=${mb#*:}
           timeout $(( 570 - SECONDS )) python3 -m experiments.probes.layer_kernels --preset $m --batch $b --seq 4096 \
             --variants norm --out $OUT/layer_${m}_b$b.json 2>&1 | tail -5
         done
         exit 0 ;;
      3) T="$R/moe/q30b_8k_megatrain.json $R/moe/120b_L12_megatrain.json $R/largest/32b_L88_16seq_megatrain.json" ;;
      4) # Two A/Bs at 7B on 4 GPUs, three runs, about 9 minutes, each with its last step's timeline.
         # (a) main; (b) with setup_overlap.patch on this copy: the filling rank takes the waiting ranks'
         # cores, and inductor's check of the CPU's vector instruction sets runs beside the data and the
         # store, the AdamW built after the fill. Prediction (b against a): setup_s.fill 24 -> about
         # 10 s (one rank's fill at 7B), setup_s.optimizer_kernel 55 -> about 20 s (what data, store
         # and fill do not hide of the check), the step unchanged. (c) the patch and 14 optimizer threads
         # a rank instead of 16: the GPU idled 0.25-0.51 s a step while 4 ranks issued work (0.03 with
         # one), reduce_s now timed apart; prediction: with 2 of each rank's cores left to its main and
         # NCCL threads the idle beside reduce_s falls below 0.1 s and 4 GPUs reach about 3.95x one
         # (3.885 measured), the AdamW (1.25 s busy of a 6.8 s step) still hidden.
         mkdir -p $OUT/ab && for run in a:16 b:16 c:14; do
           v=${run%:*} t=${run#*:}
           [ $v = b ] && git apply results/h200x4/next/setup_overlap.patch
           timeout $(( 585 - SECONDS )) python3 -m suite run --system megatrain --preset qwen2.5-7b --seq 4096 --batch 32 --accum 2 --steps 5 \
             --warmup 2 --timeout 900 --gpus 4 engine.checkpoint_every=1 engine.optimizer_threads=$t trace=$OUT/ab/7b_g4_$v.trace.json \
             --out $OUT/ab/7b_g4_$v.json > $OUT/ab/7b_g4_$v.log 2>&1
         done
         git apply -R results/h200x4/next/setup_overlap.patch
         python3 -m suite table $OUT/ab; exit 0 ;;
      5) # the points every machine's grid shares (issue 25: compared with the other machines), about 4 minutes
         G="" T="$R/shared/3b_L8_megatrain.json $R/shared/3b_L8_megatrain_K1.json $R/shared/3b_L8_native.json" ;;
    esac
    experiments/workflow_gpu.sh --detach $((560 - SECONDS)) h200x4 $T $G 2>&1 | tail -12 ;;  # the call's 600 s, the A/B included
  attach)
    experiments/workflow_gpu.sh --attach 540 h200x4 2>&1 | tail -8 ;;
esac
python3 -m suite table $R/gpus $R/moe $R/largest 2>&1 | tail -24
