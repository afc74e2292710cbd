#!/usr/bin/env bash
# The MoE layer probe of the lean experts, one H200 (any host), carrying [".whl"]:
#   C=<commit> bash results/h200/next/lean_probe.sh
# Run in session 25 (results/h200/probes_2026-11-26/, with the change applied; it is on main since).
# A first run of every variant of a model in one process lost two variants without a word (the
# probe builds a trainer per variant, and on this host the earlier ones' host memory is not all
# given back: past the host's memory the kernel kills the process). Here each variant runs in a
# process of its own, with Python's fault handler on, its exit status printed and the host's used
# memory sampled every second; then GPT-OSS's library and lean variants in one process, for the
# memory it takes.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONFAULTHANDLER=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
mkdir -p $OUT/probes
probe() {  # preset variants out: the probe's last lines, its exit status and the host's peak used GiB
  (while sleep 1; do free -g | awk '/Mem:/ {print $3}'; done) > /tmp/mem.txt &
  local sampler=$!
  timeout $((580 - SECONDS)) python3 -m experiments.probes.layer_kernels --preset $1 --batch 8 --seq 4096 \
    --variants $2 --out $OUT/probes/$3.json > $OUT/probes/$3.log 2>&1
  local rc=$?
  kill $sampler
  echo "$1 $2: exit $rc, host used at most $(sort -n /tmp/mem.txt | tail -1) GiB" | tee -a $OUT/probes/exits.txt
  grep -v "UserWarning\|_warn_once" $OUT/probes/$3.log | tail -4
}
probe qwen3-30b-a3b experts_lean_gate layer_qwen3-30b-a3b_b8_lean_gate
probe gpt-oss-20b experts_lean layer_gpt-oss-20b_b8_lean
probe gpt-oss-20b experts_lean_gate layer_gpt-oss-20b_b8_lean_gate
probe gpt-oss-20b experts_library,experts_lean layer_gpt-oss-20b_b8_library_lean
echo "done at $SECONDS s"
