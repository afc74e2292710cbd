#!/usr/bin/env bash
# Run workflow targets on the GPU machine within one call, and pack what they wrote.
#   experiments/workflow_gpu.sh SECONDS PROFILE TARGET ... [--config grid=GRID]   (targets first: --config takes what follows)
#   e.g. 480 h100 results/h100/points/scale/3b_native.json; 540 h100 targets --config grid=workflows/grids/h100-speed.yaml
# Installs a carried wheel folder (WHEELS, default .whl; WHEELS=none: the machine has everything) into
# /tmp/site and the carried .libaio (ZeRO-Infinity, baselines/libaio.sh), runs
# `snakemake --profile profiles/PROFILE ...` until SECONDS after this script's start (a point cut there is rerun next time:
# Snakemake removes its incomplete output), packs what it wrote in results/, plots/ and logs/ of the
# grid's hardware into $OUT/workflow.tgz: the files newer than the run's start (and those a detached
# run joined from the last one), so that unpacking it
# never replaces the caller's own files (a README or a script edited while the run went on) with the
# copies the call began from; then prints the harness's table of the point folders named.
# The wheel folder holds, for the machine's Python, what its image lacks: `pip download` (or
# `pip wheel`) of snakemake, datasets, hjson, pydantic>=2 and deepspeed==0.19.8 (built with
# DS_BUILD_OPS=0: its ops compile on the machine at first use), with their dependencies, leaving out
# what the image ships (torch, transformers, pandas, ...) so that nothing shadows it; colossalai for
# Gemini as baselines/gemini.md says.
#
# Work longer than one call (a call lasts at most 10 minutes) runs detached, in its own session, and
# outlives the call while the machine stays held, i.e. while the next call comes within the machine's
# idle release (30 s here):
#   [DEADLINE=S] experiments/workflow_gpu.sh --detach SECONDS PROFILE TARGET[@SECONDS] ...   start it, wait until SECONDS after this script's start, pack
#   experiments/workflow_gpu.sh --attach SECONDS PROFILE              wait until SECONDS after this script's start, pack
# (the set-up, the wheels' install and the tree's copy, counts within SECONDS: the caller's call limit is
# SECONDS plus the table and the pack, a few seconds)
# A detached run makes its targets one after another in the order given (one snakemake each, the
# options after the targets passed to every one), cheapest first as the caller lists them. A target
# may be several joined by commas, made by one snakemake (a group's one start instead of one a
# point), which runs them in the grid's order (the point rule's priority).
# A target, or each target of a group, may end in @SECONDS, what it is expected to take (python -m
# workflows.scripts.estimate): with DEADLINE set (the seconds after this script's start at which the
# machine is expected to go), a detached run starts no target that would not end by then, and names
# it in its log as skipped, so that a session's end does not cut a point off (its time lost:
# Snakemake removes it) where a shorter one after it fits; of a group, it makes those that end by
# then after the group's members before them. Without DEADLINE the estimates are ignored.
# A new --detach is refused while the last one's run still goes; the results and logs a finished one
# wrote join the new tree (a pack of them may not have come back).
# Each packs what is written so far (results are written whole or not at all), prints the run's log
# tail and leaves its whole log, every job's start time in it, as $OUT/detached.log (the next calls'
# plan reads the set-up's and each point's wall from it).
# A detached run works in its own copy of the tree ($WORKFLOW_GPU_STATE/tree, default under
# /tmp/workflow_gpu; the carried folders with it, RATEL_HOME moved along, a .venv left out). Each call
# first copies the caller's tree to the machine, replacing its carried folders and removing the files
# that tree lacks: a run working there would lose a finished point whose pack did not come back, and
# could have its Ratel checkout replaced under it. In its own copy every pack holds all the run has
# written, whichever call packs it.
set -uo pipefail
mode=run
case "${1:-}" in --detach | --attach) mode=${1#--}; shift ;; esac
limit=$1 profile=$2; shift 2
state=$(realpath -m "${WORKFLOW_GPU_STATE:-/tmp/workflow_gpu}")  # a detached run's log, exit status, pid, hardware and tree
[ -n "${OUT:-}" ] && OUT=$(cd "$OUT" && pwd)  # the pack's folder, wherever the run's tree is
running() { [ -f "$state/pid" ] && [ ! -f "$state/rc" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null; }
# The grid's hardware (what is packed): `grid=` among the arguments, else the profile's grid.
hw=$(python3 - "profiles/$profile/workflow.yaml" "$@" <<'PY'
import sys, yaml
grids = [a[5:] for a in sys.argv[2:] if a.startswith("grid=")]
grids = grids or [yaml.safe_load(open(sys.argv[1]))["grid"]]
print(yaml.safe_load(open(grids[-1]))["hardware"])
PY
)
if [ "$mode" = detach ]; then
  if running; then
    echo "a detached run is still going on this machine: --attach to it (or end process $(cat "$state/pid") and remove $state)"
    exit 1
  fi
  rm -rf "$state.last" && { [ ! -d "$state" ] || mv "$state" "$state.last"; } && mkdir -p "$state/tree" \
    && echo "$hw" > "$state/hw" || exit 1
  export MEGATRAIN_GIT_COMMIT=${MEGATRAIN_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
  tar -cf - --exclude=./.venv . | tar -xf - -C "$state/tree" || exit 1  # a local virtual environment stays
  touch "$state/started"  # what the run writes is newer; the copied tree keeps its files' times
  # what the last run wrote (newer than its start) or had joined itself, where the caller's tree
  # lacks it: not the files it had only copied, so a result the caller removed (stale, to be made
  # again) stays removed. Listed in `joined`, which every pack adds (their times are the last run's)
  : > "$state/joined"
  [ -f "$state.last/started" ] && (cd "$state.last/tree" \
    && { find results logs -type f -newer ../started 2>/dev/null; cat ../joined 2>/dev/null; }) | sort -u \
    | while IFS= read -r f; do
        [ -e "$state/tree/$f" ] || [ ! -f "$state.last/tree/$f" ] || { mkdir -p "$state/tree/${f%/*}" \
          && cp -p "$state.last/tree/$f" "$state/tree/$f" && echo "$f"; }
      done > "$state/joined"
  rm -rf "$state.last"
  [ -n "${RATEL_HOME:-}" ] && export RATEL_HOME=${RATEL_HOME/#$PWD/$state/tree}
  cd "$state/tree" || exit 1
fi
if [ "$mode" = run ]; then
  started=$(mktemp) && trap 'rm -f "$started"' EXIT
else
  started=$state/started
fi
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
    timeout --signal=INT --kill-after=30 $((limit - SECONDS)) python3 -m snakemake --profile "profiles/$profile" "$@"
    echo "snakemake exit $?" ;;
  detach)
    targets=() && while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do targets+=("$1"); shift; done
    echo "${targets[*]}" | sed 's/@[0-9]*//g' > "$state/targets"
    left=${DEADLINE:+$((DEADLINE - SECONDS))}  # the deadline, in the detached run's own seconds
    setsid bash -c 's=$1 p=$2 left=$3 n=$4; shift 4; rc=0
      for t in "${@:1:n}"; do
        made=() used=0
        for m in ${t//,/ }; do  # a group member by member: each that ends before the deadline after those taken
          e=; case $m in *@*) e=${m##*@} m=${m%@*} ;; esac
          if [ -n "$left" ] && [ -n "$e" ] && [ $((SECONDS + used + e)) -gt "$left" ]; then
            echo "skipped, about $e s with $((left - SECONDS - used)) s left before the deadline: $m"; continue
          fi
          made+=("$m") used=$((used + ${e:-0}))
        done
        [ ${#made[@]} -eq 0 ] || python3 -m snakemake --profile "profiles/$p" "${made[@]}" "${@:n+1}" || rc=$?
      done
      echo $rc > "$s/rc"' _ "$state" "$profile" "$left" ${#targets[@]} "${targets[@]}" "$@" > "$state/log" 2>&1 < /dev/null &
    echo $! > "$state/pid"
    echo "detached: snakemake --profile profiles/$profile, ${#targets[@]} target(s) in order: ${targets[*]} $* (log $state/log)" ;;
esac
if [ "$mode" != run ]; then
  [ -d "$state/tree" ] || { echo "no detached run on this machine (it went back, or none was started)"; exit 1; }
  hw=$(cat "$state/hw") && cd "$state/tree" && set -- $(cat "$state/targets" 2>/dev/null) || exit 1
  while running && [ $SECONDS -lt "$limit" ]; do sleep 5; done
  tail -n 20 "$state/log" 2>/dev/null
  cp "$state/log" "${OUT:-.}/detached.log" 2>/dev/null
  if [ -f "$state/rc" ]; then echo "snakemake exit $(cat "$state/rc")"
  elif running; then echo "still running: --attach again within 30 s"
  else echo "the detached run ended without an exit status (its log above)"; fi
fi
# the pack first: a call cut by its limit while the table prints still brings its results back
written=$(ls -d "results/$hw" "plots/$hw" "logs/$hw" 2>/dev/null)
{ [ -z "$written" ] || { find $written -type f -newer "$started" -print0
  [ "$mode" = run ] || grep -E "^($(echo $written | tr ' ' '|'))/" "$state/joined" 2>/dev/null | tr '\n' '\0'; }; } \
  | sort -zu | tar czf "${OUT:-out}/workflow.tgz" --null -T -
# the harness's table of the point folders named that hold a result (an experiment's target prints its own)
dirs=$(for t in $(echo "$@" | tr , ' '); do case $t in results/*/points/*/*.json) dirname "$t" ;; esac; done | sort -u \
  | while read -r d; do [ -d "$d" ] && echo "$d"; done)
[ -z "$dirs" ] || python3 -m suite table $dirs
