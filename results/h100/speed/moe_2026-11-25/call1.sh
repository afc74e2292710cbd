#!/usr/bin/env bash
# Session 19, issue 23: the first mixture-of-experts points on a GPU, asked of the single-GPU
# `nvidia-h200` kind, which ran it on an H100 (126 GiB host: the x2 host was not lent), so only
# shapes whose host plan fits that host:
# Qwen3-30B-A3B on 6 of its 48 layers at the grid's 8 x 4096 (traced) and at 2 x 4096 (where the
# link should bind, docs/moe.md), PyTorch native on the same 6 layers, and GPT-OSS-120B on 1 layer at 4 x 4096 with 2 slabs (its 12.9 GB float32 gradient slabs).
# Run as: C=<commit> bash call1.sh
set -u
G=workflows/grids/h200-scale.yaml
pt() { python -m workflows.scripts.grid $G "$1" | sed 's/ --timeout [0-9]*//'; }
mkdir -p $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
run() { # name end_by trace(0/1) args...
  local name=$1 end=$2 tr=$3; shift 3
  local left=$((end - SECONDS)); [ $left -lt 60 ] && { echo "skip $name: $left s left"; return; }
  local t=(); [ $tr = 1 ] && t=(trace=$OUT/new/$name.trace.json)
  MEGATRAIN_GIT_COMMIT=$C timeout $((left + 20)) python -m suite run "$@" --timeout $((left - 10)) "${t[@]}" \
    --out $OUT/new/$name.json > $OUT/new/$name.log 2>&1
  echo "$name rc $? at $SECONDS s"
}
L6=$(pt moe/q30b_L6_megatrain)
run q30b_L6_b8 200 1 $L6
run q30b_L6_b2 300 0 ${L6/--batch 8/--batch 2}
run q30b_L6_native 410 0 $(pt moe/q30b_L6_native)
run 120b_L1_b4 540 0 $(pt moe/120b_L3_megatrain | sed "s/num_hidden_layers=3/num_hidden_layers=1/; s/--batch 8 --accum 4/--batch 4 --accum 1/") engine.grad_slabs=2
free -g | head -2
python -m suite table $OUT/new
