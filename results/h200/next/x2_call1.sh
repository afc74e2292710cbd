#!/usr/bin/env bash
# The GPU tests of the tree on the H200s of whatever host runs it (the two-GPU ones where there are
# two), carrying [".whl", ".libaio"]: C=<commit> bash results/h200/next/x2_call1.sh
# About 2 minutes on one H200 (session 25, 78ee292: pytest_gpu_78ee292.txt), the two-GPU cases
# some 5 minutes more. Its other two parts ran in session 25 and their changes landed: the lean
# experts' check and layer probes (then lean_probe.sh, a process per variant), and the router loss
# over the ranks' two-GPU check with the x2 host's bandwidth probe (results/h200/README.md). With it,
# the pending test of trainer_freed_gpu_test.patch: the layer probe's trainers seemed to keep their
# host memory on a GPU host; the test names what holds a dropped trainer's store, if anything does.
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# the pending GPU test that a closed trainer is freed (trainer_freed_gpu_test.patch), on this copy only
git apply results/h200/next/trainer_freed_gpu_test.patch
# -u: a cut run keeps its lines
timeout $((585 - SECONDS)) python3 -u -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 \
  | grep -v "^DEBUG" | tee $OUT/pytest_gpu.txt | tail -4
git apply -R results/h200/next/trainer_freed_gpu_test.patch
echo "done at $SECONDS s"
