#!/usr/bin/env bash
# Prepared in sessions 19-23 for the first two `nvidia-h200-x2` calls (results/h200/README.md, "what
# is left", step 1), carrying [".whl", ".libaio"]. Run as: C=<commit> bash results/h200/next/x2_call1.sh a|b|c
# a (about 9 minutes): the GPU tests of the tree on this host's H200s, the two-GPU ones among them
#   (the whole file took 288 s on one H100 in session 20, before the two-GPU cases). The refusals
#   this call also made at first ran in session 24, with x2_calls.sh's batch 1;
# b (about 8 minutes): the pending `moe_router_loss_over_ranks.patch` on this copy only, its 2-GPU check
#   alone (cut twice on the x4 host, where the dense case ran first in the same 180-240 s); inductor's
#   check of the CPU's vector instruction sets both ways (experiments/probes/adamw_build.py); this
#   host's bandwidth probe, quick (the step model has no memcpy rate for it).
# c (about 8 minutes): the pending `lean_experts.patch` (engine.experts_kernel: lean and, with
#   engine.mlp_kernel: compiled, their gate compiled: the GPU's defaults for a mixture of experts in it)
#   on this copy only: its GPU tests and the MoE tests beside it, then the layer probe of
#   Qwen3-30B-A3B and GPT-OSS-20B at 8 x 4096 with the library's experts, the lean ones, and the lean
#   ones with the compiled gate, in one process each. Predicted (written before it runs, from the
#   four-GPU host's kernel breakdown: the masked fills 11.9 and 12.2 ms, the index backward 2.7 and
#   12.3 ms of 75.3 and 125.6 ms, what replaces them a few ms; the gate's elementwise passes, about 7
#   forward (twice, with the recompute) and 10 backward over the routed rows, about 0.4 ms each for
#   Qwen3 and 0.7 for GPT-OSS, against one each way): the library's variant where the x4 host's was
#   (236, 199) within 3%; lean: Qwen3 270-285 model TFLOP/s, GPT-OSS-20B 230-240; lean with the
#   compiled gate: Qwen3 275-295, GPT-OSS-20B 255-290.
# What each writes comes back under $OUT.
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
case $1 in
  a)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # -u: a cut run keeps its lines
    timeout $((585 - SECONDS)) python3 -u -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 \
      | tee $OUT/pytest_gpu.txt | tail -4 ;;
  b)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    git apply results/h200/next/moe_router_loss_over_ranks.patch  # the pending change, on the machine's copy only
    timeout 300 python3 -u -m pytest -v -p no:cacheprovider --durations=0 -k "two_gpus_track and gpt" tests/test_gpu.py 2>&1 \
      | tee $OUT/pytest_moe_two_gpus.txt | tail -6
    git apply -R results/h200/next/moe_router_loss_over_ranks.patch
    mkdir -p $OUT/probes
    for c in inductor engine; do
      ISA_CHECK=$c CUDA=1 timeout 60 python3 -m experiments.probes.adamw_build | tee -a $OUT/probes/adamw_build.jsonl
    done
    timeout $((585 - SECONDS)) python3 -m experiments.probes.bandwidth --quick --out $OUT/probes/bandwidth.json 2>&1 | tail -12 ;;
  c)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    git apply results/h200/next/lean_experts.patch  # the pending change, on the machine's copy only
    timeout 200 python3 -u -m pytest -v -p no:cacheprovider --durations=0 -k "lean or moe_bf16 or moe_streaming" \
      tests/test_gpu.py tests/test_lean_experts.py 2>&1 | tee $OUT/pytest_lean_experts.txt | tail -6
    mkdir -p $OUT/probes
    for m in qwen3-30b-a3b gpt-oss-20b; do  # the first takes half of what is left; each writes after every variant
      [ $m = gpt-oss-20b ] && t=$((585 - SECONDS)) || t=$(((585 - SECONDS) / 2))
      timeout $t python3 -m experiments.probes.layer_kernels --preset $m --batch 8 --seq 4096 \
        --variants experts_library,experts_lean,experts_lean_gate --out $OUT/probes/layer_${m}_b8.json 2>&1 | tail -6
    done
    git apply -R results/h200/next/lean_experts.patch ;;
esac
echo "done at $SECONDS s"
