#!/usr/bin/env bash
# Named benchmark points on this machine's GPU, one process per point (python -m suite run); table last.
#   OUT=results/h100/speed experiments/points.sh GROUP|POINT ...
# Groups: targets, device_tiles, kept, auto, depth, ablations (the speed issue), baselines3b, baselines7b (the harness issue).
# Each point writes $OUT/<point>.json and $OUT/<point>.log; POINT_TIMEOUT (seconds, default 600) bounds each.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
W7="--preset qwen2.5-7b"
B3="--preset qwen2.5-3b"
K1="engine.checkpoint_every=1"
declare -A POINTS=(
  # targets: Qwen2.5-7B, seq 4096, 16 sequences per step, float32 masters, no clipping
  [7b_16seq_mb4_K1]="megatrain $W7 --batch 4 --accum 4 $K1 ceiling=true trace=$OUT/7b_16seq_mb4_K1.trace.json"
  [7b_16seq_mb8_K1]="megatrain $W7 --batch 8 --accum 2 $K1 ceiling=true"
  [3b_4seq_K1]="megatrain $B3 --batch 4 --accum 1 $K1 ceiling=true"
  # device tiles: the embedding and the first layers' master and moments on the GPU, updated there
  [7b_16seq_mb8_K1_dt3]="megatrain $W7 --batch 8 --accum 2 $K1 engine.device_tiles=3 ceiling=true trace=$OUT/7b_16seq_mb8_K1_dt3.trace.json"
  [3b_4seq_K1_dt1]="megatrain $B3 --batch 4 $K1 engine.device_tiles=1 ceiling=true"
  [3b_4seq_K1_dt12]="megatrain $B3 --batch 4 $K1 engine.device_tiles=12 ceiling=true"
  [3b_4seq_K1_dt20]="megatrain $B3 --batch 4 $K1 engine.device_tiles=20 ceiling=true trace=$OUT/3b_4seq_K1_dt20.trace.json"
  # layers kept from recompute (engine.no_recompute_layers: auto, as many as the memory plan fits)
  [7b_16seq_mb8_K1_dt3_kept]="megatrain $W7 --batch 8 --accum 2 $K1 engine.device_tiles=3 engine.no_recompute_layers=auto ceiling=true"
  [7b_16seq_mb4_K1_dt3_kept]="megatrain $W7 --batch 4 --accum 4 $K1 engine.device_tiles=3 engine.no_recompute_layers=auto ceiling=true"
  [3b_4seq_K1_dt20_kept]="megatrain $B3 --batch 4 $K1 engine.device_tiles=20 engine.grad_slabs=12 engine.no_recompute_layers=auto ceiling=true trace=$OUT/3b_4seq_K1_dt20_kept.trace.json"
  # device tiles and kept layers chosen by the plan (auto), beside the hand-picked settings above and
  # the width grid's 1.0x and 2.0x points at their defaults (results/h100/points/width)
  [3b_4seq_K1_auto]="megatrain $B3 --batch 4 $K1 engine.device_tiles=auto engine.grad_slabs=12 engine.no_recompute_layers=auto"
  [7b_16seq_mb8_K1_auto]="megatrain $W7 --batch 8 --accum 2 $K1 engine.device_tiles=auto engine.no_recompute_layers=auto"
  [w1.0_auto]="megatrain $W7 --layers 2 --batch 4 engine.device_tiles=auto engine.no_recompute_layers=auto"
  [w2.0_auto]="megatrain $W7 --layers 2 --override=hidden_size=7168 --override=intermediate_size=37888 --override=num_attention_heads=56 --override=num_key_value_heads=8 --batch 4 engine.device_tiles=auto engine.no_recompute_layers=auto"
  # depth: the 7B width at 7, 14, 28 layers, checkpoints offloaded (device memory flat in depth)
  [depth_7b_L7]="megatrain $W7 --layers 7 --batch 8 --accum 2 $K1 engine.offload_checkpoints=true"
  [depth_7b_L14]="megatrain $W7 --layers 14 --batch 8 --accum 2 $K1 engine.offload_checkpoints=true"
  [depth_7b_L28]="megatrain $W7 --layers 28 --batch 8 --accum 2 $K1 engine.offload_checkpoints=true"
  # ablations (the paper's Table 4) on the 7B width at 14 layers, 16 sequences of 4096
  [abl_base_K1]="megatrain $W7 --layers 14 --batch 4 --accum 4 --warmup 1 $K1"
  [abl_K2]="megatrain $W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=2"
  [abl_K4]="megatrain $W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=4"
  [abl_K8]="megatrain $W7 --layers 14 --batch 4 --accum 4 --warmup 1 engine.checkpoint_every=8"
  [abl_one_buffer]="megatrain $W7 --layers 14 --batch 4 --accum 4 --warmup 1 $K1 engine.weight_buffers=1"
  [abl_sync_grads]="megatrain $W7 --layers 14 --batch 4 --accum 4 --warmup 1 $K1 engine.grad_slabs=0"
  # every system on the Qwen2.5-3B shape, seq 4096: 4 sequences (native's largest) and 8
  [3b_native_b4]="native $B3 --batch 4"
  [3b_native_b8]="native $B3 --batch 8"
  [3b_megatrain_b4]="megatrain $B3 --batch 4 $K1"
  [3b_megatrain_b8]="megatrain $B3 --batch 8 $K1"
  [3b_megatrain_b4x4]="megatrain $B3 --batch 4 --accum 4 $K1"
  [3b_megatrain_b16]="megatrain $B3 --batch 16 $K1"
  [3b_fsdp2_b4]="fsdp2 $B3 --batch 4"
  [3b_fsdp2_b8]="fsdp2 $B3 --batch 8"
  [3b_fsdp2_b16]="fsdp2 $B3 --batch 16"
  [3b_zero3_b4]="zero3 $B3 --batch 4"
  [3b_zero3_b8]="zero3 $B3 --batch 8"
  [3b_zero3_b16]="zero3 $B3 --batch 16"
  [3b_zero_infinity_b4]="zero_infinity $B3 --batch 4"
  [3b_zero_infinity_b8]="zero_infinity $B3 --batch 8 --steps 1 --warmup 1"
  [3b_zero_infinity_b16]="zero_infinity $B3 --batch 16 --steps 1 --warmup 1"
  [3b_gemini_b4]="gemini $B3 --batch 4"
  [3b_gemini_b8]="gemini $B3 --batch 8"
  [3b_gemini_b6]="gemini $B3 --batch 6 --steps 3 --warmup 1"
  [3b_gemini_b7]="gemini $B3 --batch 7 --steps 3 --warmup 1"
  [3b_ratel_b4]="ratel $B3 --batch 4"
  # and on the 7B shape (host memory refuses some: that is a result)
  [7b_megatrain_b8x2]="megatrain $W7 --batch 8 --accum 2 $K1"
  [7b_native_b4]="native $W7 --batch 4"
  [7b_fsdp2_b4]="fsdp2 $W7 --batch 4"
  [7b_zero3_b4]="zero3 $W7 --batch 4"
  [7b_zero_infinity_b4]="zero_infinity $W7 --batch 4"
)
declare -A SETS=(
  [targets]="7b_16seq_mb4_K1 7b_16seq_mb8_K1 3b_4seq_K1"
  [device_tiles]="3b_4seq_K1_dt1 3b_4seq_K1_dt12 3b_4seq_K1_dt20 7b_16seq_mb8_K1_dt3"
  [kept]="7b_16seq_mb8_K1_dt3_kept 7b_16seq_mb4_K1_dt3_kept 3b_4seq_K1_dt20_kept"
  [auto]="w1.0_auto w2.0_auto 3b_4seq_K1_auto 7b_16seq_mb8_K1_auto"
  [depth]="depth_7b_L7 depth_7b_L14 depth_7b_L28"
  [ablations]="abl_base_K1 abl_K2 abl_K4 abl_K8 abl_one_buffer abl_sync_grads"
  [baselines3b]="3b_native_b4 3b_native_b8 3b_megatrain_b4 3b_megatrain_b8 3b_megatrain_b4x4 3b_megatrain_b16 3b_fsdp2_b4 3b_fsdp2_b8 3b_fsdp2_b16 3b_zero3_b4 3b_zero3_b8 3b_zero3_b16 3b_zero_infinity_b4 3b_gemini_b4 3b_gemini_b8 3b_ratel_b4"
  [baselines7b]="7b_megatrain_b8x2 7b_native_b4 7b_fsdp2_b4 7b_zero3_b4 7b_zero_infinity_b4"
)
names=()
for arg in "$@"; do
  if [ -n "${SETS[$arg]:-}" ]; then names+=(${SETS[$arg]}); else names+=("$arg"); fi
done
for name in "${names[@]}"; do
  [ -n "${POINTS[$name]:-}" ] || { echo "unknown point or group: $name" >&2; exit 2; }
  read -r system args <<< "${POINTS[$name]}"
  echo "== $name" >&2
  python3 -m suite run --system "$system" --timeout "${POINT_TIMEOUT:-600}" --out "$OUT/$name.json" $args
done
python3 -m suite table "$OUT"
