#!/usr/bin/env bash
# Prepared in session 19 for the next H100 call: were the memory plan to count the compiled loss's
# head chunk in bf16, `device_tiles: auto` at 7B and 4 x 4096 would pick 20 tiles where calls 1-2
# had 19 (the plan's choice today). The two alternated twice on one machine before that change;
# no difference beyond the spread is expected (../README.md).
# Run as: C=<commit> bash results/h100/speed/loss_kernel_2026-11-25/call3.sh
set -u
A=$(python -m workflows.scripts.grid workflows/grids/h100-speed.yaml short_step/7b_4seq_auto | sed 's/ trace=[^ ]*//')
mkdir -p $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_GIT_COMMIT=$C
i=0
for round in 1 2; do
  for tiles in auto 20; do
    i=$((i + 1)); left=$((40 + 130 * i - SECONDS)); [ $left -lt 60 ] && { echo "skip $tiles $round"; continue; }
    # the harness writes NAME.log itself: the command's lines go to commands.log
    timeout $left python -m suite run $A engine.device_tiles=$tiles \
      --out $OUT/new/7b_4seq_tiles_${tiles}_r$round.json >> $OUT/new/commands.log 2>&1
    echo "$tiles r$round rc $? at $SECONDS s"
  done
done
python -m suite table $OUT/new
