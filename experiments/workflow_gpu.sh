#!/usr/bin/env bash
# Run workflow targets on the GPU machine within one call, and pack what they wrote.
#   experiments/workflow_gpu.sh SECONDS PROFILE TARGET ...    (e.g. 480 h100 results/h100/points/scale/3b_native.json)
# Installs a carried wheel folder (WHEELS, default .whl: snakemake, deepspeed and what the image lacks,
# built with ../shared/tools/device-wheels.sh; WHEELS=none: the machine has them) into /tmp/site and
# the carried .libaio (ZeRO-Infinity), runs `snakemake --profile PROFILE TARGET ...` for at most
# SECONDS (a point cut there is rerun next time: Snakemake removes its incomplete output), then packs
# results/, plots/ and logs/ of the profile's hardware into $OUT/workflow.tgz.
#
# Work longer than one call (a call lasts at most 10 minutes) runs detached, in its own session, and
# outlives the call while the machine stays held, i.e. while the next call comes within the machine's
# idle release (30 s here):
#   experiments/workflow_gpu.sh --detach SECONDS PROFILE TARGET ...   start it, wait up to SECONDS, pack
#   experiments/workflow_gpu.sh --attach SECONDS PROFILE              wait up to SECONDS more, pack
# Each packs what is written so far (results are written whole or not at all) and the run's log tail.
# Keep every pack: each call first copies this working tree to the machine, which removes the files
# the run wrote that this tree lacks (session 6: FSDP2's accuracy result, written before --attach,
# was only in the first pack; the summary, computed in memory, still had it).
set -uo pipefail
mode=run
case "${1:-}" in --detach | --attach) mode=${1#--}; shift ;; esac
limit=$1 profile=$2; shift 2
state=/tmp/workflow_gpu  # a detached run's log and exit status
if [ "$mode" != attach ]; then
  WHEELS=${WHEELS:-.whl}
  if [ "$WHEELS" != none ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH || exit 1
  fi
  [ -d .libaio ] && eval "$(baselines/libaio.sh env .libaio)"
fi
export PYTHONUNBUFFERED=1
case $mode in
  run)
    timeout --signal=INT --kill-after=30 "$limit" python3 -m snakemake --profile "$profile" "$@"
    echo "snakemake exit $?" ;;
  detach)
    rm -rf "$state" && mkdir -p "$state"
    setsid bash -c 'python3 -m snakemake --profile "$@"; echo $? > '"$state"'/rc' _ "$profile" "$@" \
      > "$state/log" 2>&1 < /dev/null &
    echo "detached: snakemake --profile $profile $* (log $state/log)" ;;
esac
if [ "$mode" != run ]; then
  [ -d "$state" ] || { echo "no detached run on this machine (it went back, or none was started)"; exit 1; }
  end=$((SECONDS + limit))
  while [ ! -f "$state/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  tail -n 20 "$state/log"
  if [ -f "$state/rc" ]; then echo "snakemake exit $(cat "$state/rc")"; else echo "still running: --attach again within 30 s"; fi
fi
hw=$(python3 -c "import yaml,sys; p=yaml.safe_load(open('profiles/$profile/config.yaml')); g=[c for c in p['config'] if c.startswith('grid=')][0][5:]; print(yaml.safe_load(open(g))['hardware'])")
tar czf "${OUT:-out}/workflow.tgz" $(ls -d "results/$hw" "plots/$hw" "logs/$hw" 2>/dev/null)
