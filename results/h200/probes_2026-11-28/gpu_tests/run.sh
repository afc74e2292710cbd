#!/usr/bin/env bash
# Ran in session 47 on `nvidia-h200` (one H200, 16 cores, 128 GiB), carrying [".whl", ".libaio"]:
# 1. `results/h200/next/x2_calls.sh tests 1`, then `tests 2` at b6b33f4 (139 and 113 s wall; that mode is
#    gone since: `next/x2_call1.sh one` and `two` split the file by one and two GPUs):
#    pytest_gpu_1.txt, pytest_gpu_2.txt (the two-GPU cases skipped: one GPU).
# 2. At b6b33f4, the baselines' one-process groups on a GPU: ZeRO-3 Offload, FSDP2, ZeRO-3 again and
#    ZeRO-Infinity built and closed one after another in one process (tiny-llama), then one worker
#    each of ZeRO-3 Offload and FSDP2 at the 7B shape on 4 layers, 4 x 4096 tokens (zero3.*, fsdp2.*):
#    the in-process sequence failed (its output cut to its last lines: FSDP2's model built under
#    DeepSpeed's zero.Init, KeyError LOCAL_RANK), the workers ran (status ok).
# 3. The new test (tests/test_gpu.py::test_a_closed_deepspeed_run_leaves_the_process_as_it_found_it),
#    with transformers' DeepSpeed config unset at close: its ZeRO-3 case passed; its ZeRO-Infinity case,
#    the second DeepSpeed run of the process, failed in DeepSpeed's ZeRO-3 optimizer ("Group ... is not
#    registered": DeepSpeed kept its reference to the closed run's group). With close through DeepSpeed's
#    own destroy_process_group (torch's, and DeepSpeed's references), the test as committed (ZeRO-3,
#    ZeRO-3 again, FSDP2) passed, beside test_baselines_grow_expandable_segments: 3 passed.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site MEGATRAIN_GIT_COMMIT=${C:-unknown}
for s in zero3 fsdp2; do
  python3 -m suite run --system $s --preset qwen2.5-7b --layers 4 --seq 4096 --batch 4 --steps 2 --warmup 1 --timeout 240 \
    --out $OUT/$s.json > $OUT/$s.txt 2>&1
done
python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu.py -k "closed_deepspeed or baselines_grow"
