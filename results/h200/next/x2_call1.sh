#!/usr/bin/env bash
# Prepared in sessions 19-23 for the first two `nvidia-h200-x2` calls (results/h200/README.md, "what
# is left", step 1), carrying [".whl", ".libaio"]. Run as: C=<commit> bash results/h200/next/x2_call1.sh a|b
# a (about 9 minutes): the GPU tests of the tree on this host's H200s, the two-GPU ones among them
#   (the whole file took 288 s on one H100 in session 20, before the two-GPU cases). The refusals
#   this call also made at first ran in session 24, with x2_calls.sh's batch 1;
# b (about 8 minutes): the pending `moe_router_loss_over_ranks.patch` on this copy only, its 2-GPU check
#   alone (cut twice on the x4 host, where the dense case ran first in the same 180-240 s); inductor's
#   check of the CPU's vector instruction sets both ways (experiments/probes/adamw_build.py); this
#   host's bandwidth probe, quick (the step model has no memcpy rate for it).
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
esac
echo "done at $SECONDS s"
