#!/usr/bin/env bash
# Session 20, the first call on `nvidia-h100-x2` (two H100s, 32 cores, 256 GiB host), carrying .whl.
# Run as: C=<commit> bash results/h100x2/call1.sh
# 1. issue 21's target 3 on this host: the h200-scale grid's short_step pair (Qwen2.5-14B at 4 x 4096,
#    3 device tiles, 4 and 8 gradient slabs) with the compiled kernels and loss now the GPU's
#    defaults; 14B's host state (about 195 GiB) needs this host, not the 126 GiB one-GPU machines;
# 2. the two-GPU tests (the data-parallel part slabs of session 18 have not run on GPUs);
# 3. this host's bandwidth probe.
set -u
export MEGATRAIN_GIT_COMMIT=$C TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
D=$OUT/short_step; mkdir -p $D $OUT/probes
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; nproc
  grep MemTotal /proc/meminfo; df -h /tmp | tail -1; env | grep -E 'NCCL_NVLS|MULTICAST|NVSHMEM'; } > $OUT/machine.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
G=workflows/grids/h200-scale.yaml
pt() { python3 -m workflows.scripts.grid $G "$1" | sed 's/ --timeout [0-9]*//; s#results/h200/points/short_step#'$D'#'; }
run() { # name end_by args...: the harness's timeout 30 s before the slot ends, the kill 30 s after it
  local name=$1 end=$2; shift 2
  local left=$((end - SECONDS)); [ $left -lt 90 ] && { echo "skip $name: $left s left"; return; }
  timeout $((left + 30)) python3 -m suite run "$@" --timeout $((left - 30)) --out $D/$name.json >> $D/commands.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
run 14b_4seq_dt3 200 $(pt short_step/14b_4seq_dt3)
run 14b_4seq_dt3_slabs8 370 $(pt short_step/14b_4seq_dt3_slabs8)
grep MemTotal /proc/meminfo >> $OUT/machine.txt
timeout $((540 - SECONDS)) python3 -m pytest -q -p no:cacheprovider --durations=0 tests/test_gpu.py -k "two_gpus" 2>&1 \
  | tee $OUT/pytest_two_gpus.txt | tail -4
echo "tests done at $SECONDS s"
[ $((585 - SECONDS)) -gt 40 ] && timeout $((585 - SECONDS)) python3 -m experiments.probes.bandwidth \
  --out $OUT/probes/bandwidth.json 2>&1 | tail -8
python3 -m suite table $D 2>&1 | tail -6
echo "done at $SECONDS s"
