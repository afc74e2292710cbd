#!/usr/bin/env bash
# Ran in session 26 at 92b6cae on `nvidia-h200-x2` (236 s; its outputs beside it, the logs trimmed to the
# results and dynamo's recompile lines), after session 26's first two calls there:
# 1. largest/7b_zero_infinity against the disk admission's reserve (hf.DISK_RESERVE): the detached run
#    of the point filled this disk in its first step and the machine stopped answering.
# 2. The GPU tests x2_call1.sh did not reach in its 585 s (from test_compiled_kernels_track_eager_kernels
#    [engine2] on), with the one that failed there, tiny GPT-OSS with one weight buffer and no slabs
#    (failure details cut by the limit): here with its traceback, then alone in a fresh process, both
#    with dynamo's recompile log (does a compiled kernel reach dynamo's recompile limit and run eagerly?).
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
df -h /tmp | tail -1
experiments/workflow_gpu.sh 120 h200 results/h200/points/largest/7b_zero_infinity.json \
  --config grid=workflows/grids/h200-scale.yaml 2>&1 | grep -A1 "7b_zero_infinity" | tail -3
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # workflow_gpu.sh installed the wheels there
git apply results/h200/next/trainer_freed_gpu_test.patch
failing="tests/test_gpu.py::test_moe_streaming_switches_keep_numerics[engine1-tiny-gpt-oss]"
TORCH_LOGS=recompiles timeout $((480 - SECONDS)) python3 -u -m pytest -v -rA --tb=short -p no:cacheprovider tests/test_gpu.py \
  -k "moe_streaming_switches or (compiled_kernels_track and engine2) or build_without_compile_workers or store_shadows" \
  > $OUT/pytest_gpu_rest.txt 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|Mismatch|Greatest|recompil" $OUT/pytest_gpu_rest.txt | sort | uniq -c | sort -rn | head -30
TORCH_LOGS=recompiles timeout $((560 - SECONDS)) python3 -u -m pytest -v -rA --tb=short -p no:cacheprovider "$failing" \
  > $OUT/pytest_gpu_alone.txt 2>&1
grep -E "PASSED|FAILED|passed|failed|Mismatch|Greatest|recompil" $OUT/pytest_gpu_alone.txt | sort | uniq -c | head
git apply -R results/h200/next/trainer_freed_gpu_test.patch
echo "done at $SECONDS s"
