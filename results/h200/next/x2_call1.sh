#!/usr/bin/env bash
# Prepared in session 19 for the first `nvidia-h200-x2` call (results/h200/README.md, "what is left",
# step 1), carrying [".whl", ".libaio"]. Run as: C=<commit> bash results/h200/next/x2_call1.sh
# 1. the 7 refusals by admission (15 s each, four at once: `host` and `gpu` raised, as they allocate nothing);
# 2. the GPU tests of the tree on this host's H200s, the two-GPU ones among them, with
#    `moe_router_loss_over_ranks.patch` applied: the change
#    that trains a mixture of experts with its router loss on several ranks, which lands once its
#    2-GPU check (`test_two_gpus_track_one_gpu[tiny-gpt-oss|tiny-qwen3-moe]`) passes; on the x4
#    host that check was cut by a 240 s limit while the GPT-OSS one built flex attention (it now runs eager);
# 3. the compiled AdamW's build, with and without its C++ wrapper (experiments/probes/adamw_build.py),
#    and this host's bandwidth probe, quick (the step model has no memcpy rate for it).
# Then pack what it wrote: results/h200 and plots/h200 come back in $OUT/workflow.tgz.
set -u
export MEGATRAIN_GIT_COMMIT=$C TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
P=results/h200/points
experiments/workflow_gpu.sh 150 h200 $P/scale/14b_zero_infinity.json $P/scale/32b_zero_infinity.json \
  $P/scale/72b_zero_infinity.json $P/scale/120b_megatrain.json $P/scale/120b_native.json \
  $P/scale/120b_zero3.json $P/scale/120b_zero_infinity.json --resources gpu=4 host=4 2>&1 | tail -15
cp $OUT/workflow.tgz $OUT/refusals.tgz
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
git apply results/h200/next/moe_router_loss_over_ranks.patch  # the pending change, on the machine's copy only
timeout 250 python3 -u -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 | tee $OUT/pytest_gpu.txt | tail -4  # -u: a cut run keeps its lines
git apply -R results/h200/next/moe_router_loss_over_ranks.patch
mkdir -p $OUT/probes
# where the compiled AdamW's 35-55 s of set-up per point go (at most two minutes): built twice with
# the engine's C++ wrapper and once without, one cache
for w in 1 1 0; do CUDA=1 WRAPPER=$w TORCHINDUCTOR_CACHE_DIR=/tmp/ind timeout 40 python3 -m experiments.probes.adamw_build | tee -a $OUT/probes/adamw_build.jsonl; done
timeout $((570 - SECONDS)) python3 -m experiments.probes.bandwidth --quick --out $OUT/probes/bandwidth.json 2>&1 | tail -12
echo "done at $SECONDS s"
