#!/usr/bin/env bash
# The speed issue's points on this machine's GPU, one process per point; prints a table last.
#   OUT=results/h100/speed experiments/speed.sh [point ...]      (default: every point below)
# Each point writes $OUT/<point>.json (experiments/bench.py) and $OUT/<point>.log.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
declare -A POINTS=(
  # name: bench.py arguments
  [7b_seq4096_16seq_K1]="--preset qwen2.5-7b --batch 4 --accum 4 engine.checkpoint_every=1 --ceiling --trace $OUT/7b_seq4096_16seq_K1.trace.json"
  [7b_seq4096_16seq_mb8_K1]="--preset qwen2.5-7b --batch 8 --accum 2 engine.checkpoint_every=1 --ceiling"
  [3b_seq4096_4seq]="--preset qwen2.5-3b --batch 4 --accum 1 engine.checkpoint_every=1 --ceiling"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${!POINTS[@]}")
for name in "${names[@]}"; do
  echo "== $name" >&2
  timeout "${POINT_TIMEOUT:-300}" python3 experiments/bench.py ${POINTS[$name]} --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$?" >&2; tail -2 "$OUT/$name.log" >&2
done
python3 experiments/speed_table.py "$OUT"
