#!/usr/bin/env bash
# Session 25, one H200 (any host), carrying [".whl"]: C=<commit> bash results/h200/next/lean_probe.sh
# x2_call1.sh c's layer probes of the lean experts stopped early without a word: Qwen3-30B-A3B's third
# variant (the lean experts with the compiled gate) and GPT-OSS-20B's second (lean) wrote nothing
# and printed no traceback, each after its process had run one or two variants (the probe builds
# a trainer per variant in one process). Here each variant runs in a process of its own, with
# Python's fault handler on, its exit status printed and the host's used memory sampled every
# second; then GPT-OSS's library and lean variants once more in one process, as x2_call1.sh ran them.
set -u
export MEGATRAIN_GIT_COMMIT=${C:-unknown} TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri PYTHONFAULTHANDLER=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
git apply results/h200/next/lean_experts.patch  # the pending change, on the machine's copy only
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
git apply -R results/h200/next/lean_experts.patch
echo "done at $SECONDS s"
