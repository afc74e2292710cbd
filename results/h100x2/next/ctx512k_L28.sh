#!/usr/bin/env bash
# Prepared in session 20: Qwen2.5-7B at 512K tokens on all 28 layers on one H100 of the 256 GiB host
# (`nvidia-h100-x2`), the paper's Table 7 row at full depth (issue 21's target 4 names the H200; this
# is the same run on the smaller GPU). The grid's point (`long_context/ctx512k_L28`, a checkpoint
# every 2 layers) plans 94.8 GiB of device here; with one every layer, offloaded, `megatrain plan`
# gives 225.3 GiB of host and 75.5 of device (an MLP chunk of 64K tokens). One step, no warm-up: about
# 20 s a layer (the 4-layer 512K point on the H100 x1, results/h100/points/context/ctx512k_L4.json)
# is about 9.5 minutes, plus about 2 of start and set-up, so it spans two calls:
#   C=<commit> bash results/h100x2/next/ctx512k_L28.sh start    # starts it detached, waits 560 s
#   bash results/h100x2/next/ctx512k_L28.sh attach              # within 30 s of the first call's end
# It writes outside the working tree (each call copies the tree anew) and packs what is there into $OUT.
set -u
S=/tmp/ctx512k
if [ "$1" = start ]; then
  rm -rf $S && mkdir -p $S
  export MEGATRAIN_GIT_COMMIT=$C TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri MEGATRAIN_HOST_MEMORY_GB=250
  args=$(python3 -m workflows.scripts.grid workflows/grids/h200-scale.yaml long_context/ctx512k_L28 \
    | sed 's/ --timeout [0-9]*//; s/engine.checkpoint_every=2/engine.checkpoint_every=1/')
  setsid bash -c "python3 -m suite run $args trace=$S/ctx512k_L28.trace.json --timeout 1500 --out $S/ctx512k_L28.json \
    >> $S/commands.log 2>&1; echo \$? > $S/rc" < /dev/null > /dev/null 2>&1 &
  echo "started: $args"
fi
[ -d $S ] || { echo "nothing started on this machine (it went back, or none was started)"; exit 1; }
end=$((SECONDS + ${WAIT:-560}))
while [ ! -f $S/rc ] && [ $SECONDS -lt $end ]; do sleep 5; done
grep -v Warning $S/ctx512k_L28.log 2>/dev/null | tail -5
if [ -f $S/rc ]; then echo "suite run exit $(cat $S/rc)"; python3 -m suite table $S; else echo "still running: attach again within 30 s"; fi
mkdir -p $OUT/ctx512k && cp -r $S/. $OUT/ctx512k/
