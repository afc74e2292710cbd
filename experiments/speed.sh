#!/usr/bin/env bash
# The speed issue's points on this machine's GPU, one process per point; prints a table last.
#   OUT=results/h100/speed experiments/speed.sh GROUP|POINT ...
# Groups: targets, depth, ablations. Each point writes $OUT/<point>.json (experiments/bench.py);
# their logs go to $OUT/points.log; POINT_TIMEOUT (seconds, default 300) bounds each.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W7="--preset qwen2.5-7b"
declare -A POINTS=(
  # targets: Qwen2.5-7B, seq 4096, 16 sequences per step, float32 masters, no clipping
  [7b_16seq_mb4_K1]="$W7 --batch 4 --accum 4 engine.checkpoint_every=1 --ceiling --trace $OUT/7b_16seq_mb4_K1.trace.json"
  [7b_16seq_mb8_K1]="$W7 --batch 8 --accum 2 engine.checkpoint_every=1 --ceiling"
  [3b_4seq_K1]="--preset qwen2.5-3b --batch 4 --accum 1 engine.checkpoint_every=1 --ceiling"
  # depth: the 7B width at 7, 14, 28 layers, checkpoints offloaded (device memory flat in depth)
  [depth_7b_L7]="$W7 --layers 7 --batch 8 --accum 2 engine.checkpoint_every=1 engine.offload_checkpoints=true"
  [depth_7b_L14]="$W7 --layers 14 --batch 8 --accum 2 engine.checkpoint_every=1 engine.offload_checkpoints=true"
  [depth_7b_L28]="$W7 --layers 28 --batch 8 --accum 2 engine.checkpoint_every=1 engine.offload_checkpoints=true"
  # ablations (the paper's Table 4) on the 7B width at 14 layers, 16 sequences of 4096
  [abl_base_K1]="$W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=1"
  [abl_K2]="$W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=2"
  [abl_K4]="$W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=4"
  [abl_K8]="$W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=8"
  [abl_one_buffer]="$W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=1 engine.weight_buffers=1"
  [abl_sync_grads]="$W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=1 engine.grad_slabs=0"
)
declare -A SETS=(
  [targets]="7b_16seq_mb4_K1 7b_16seq_mb8_K1 3b_4seq_K1"
  [depth]="depth_7b_L7 depth_7b_L14 depth_7b_L28"
  [ablations]="abl_base_K1 abl_K2 abl_K4 abl_K8 abl_one_buffer abl_sync_grads"
)
names=()
for arg in "$@"; do
  if [ -n "${SETS[$arg]:-}" ]; then names+=(${SETS[$arg]}); else names+=("$arg"); fi
done
for name in "${names[@]}"; do
  [ -n "${POINTS[$name]:-}" ] || { echo "unknown point or group: $name" >&2; exit 2; }
  echo "== $name" >&2
  echo "== $name" >> "$OUT/points.log"
  timeout "${POINT_TIMEOUT:-300}" python3 experiments/bench.py ${POINTS[$name]} --out "$OUT/$name.json" \
    >> "$OUT/points.log" 2>&1
  echo "$name rc=$?" >&2; tail -1 "$OUT/points.log" >&2
done
python3 experiments/speed_table.py "$OUT"
