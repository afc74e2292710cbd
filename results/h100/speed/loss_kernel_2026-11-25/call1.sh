#!/usr/bin/env bash
# Prepared in session 18 for the next H100 call (issue 24): 7B at 4 x 4096 with the defaults,
# the cross-entropy eager against compiled (engine.loss_kernel), alternated twice on one machine,
# each with its ceiling measured after the host's updates (cee076f). It gives the loss kernel's A/B,
# with the prediction in ../README.md (session 18), and target 2's ratio with its spread.
# Run as: C=<commit> bash results/h100/speed/loss_kernel_2026-11-25/call1.sh
set -u
A=$(python -m workflows.scripts.grid workflows/grids/h100-speed.yaml short_step/7b_4seq_auto | sed 's/ trace=[^ ]*//')
mkdir -p $OUT/new
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
i=0
for round in 1 2; do
  for loss in eager compiled; do
    i=$((i + 1)); left=$((40 + 130 * i - SECONDS)); [ $left -lt 60 ] && { echo "skip $loss $round"; continue; }
    MEGATRAIN_GIT_COMMIT=$C timeout $left python -m suite run $A engine.loss_kernel=$loss \
      --out $OUT/new/7b_4seq_loss_${loss}_r$round.json > $OUT/new/7b_4seq_loss_${loss}_r$round.log 2>&1
    echo "$loss r$round rc $? at $SECONDS s"
  done
done
python -m suite table $OUT/new
