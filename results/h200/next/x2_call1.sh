#!/usr/bin/env bash
# The GPU tests of the tree on the H200s of whatever host runs it, carrying [".whl", ".libaio"]:
#   C=<commit> bash results/h200/next/x2_call1.sh one|two
# `one`: the one-GPU cases, the whole set in one process (as a user's process that trains several
# models: session 26's full run is where dynamo's recompile limit showed), about 3 minutes on a fresh
# machine (session 26, one H200: probes_2026-11-26/kernel_forms/pytest_gpu.txt). `two`: the
# two-GPU cases (skipped on one GPU), about 6 minutes on the x2 host: session 26's whole file on a
# fresh x2 machine did not finish in one call's 585 s (pytest_gpu_7c32aaf_x2.txt).
set -u
# the host stated to admission (every system's): this host's MemTotal starts small and grows as memory is used
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
case ${1:-one} in one) select="not two_gpus" ;; two) select="two_gpus" ;; esac
# -u: a cut run keeps its lines
timeout $((585 - SECONDS)) python3 -u -m pytest -v -rfE -p no:cacheprovider --durations=0 tests/test_gpu.py -k "$select" 2>&1 \
  | grep -v "^DEBUG" | tee $OUT/pytest_gpu_$1.txt | tail -6
echo "done at $SECONDS s"
