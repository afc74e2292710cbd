#!/usr/bin/env bash
# Run workflow targets on the GPU machine within one call, and pack what they wrote.
#   experiments/workflow_gpu.sh SECONDS PROFILE TARGET ...    (e.g. 480 h100 results/h100/points/scale/3b_native.json)
# Installs a carried wheel folder (WHEELS, default .whl: snakemake, deepspeed and what the image lacks,
# built with ../shared/tools/device-wheels.sh) into /tmp/site and the carried .libaio (ZeRO-Infinity),
# runs `snakemake --profile PROFILE TARGET ...` for at most SECONDS (a point cut there is rerun next
# time: Snakemake removes its incomplete output), then packs results/, plots/ and logs/ of the
# profile's hardware into $OUT/workflow.tgz.
set -uo pipefail
limit=$1 profile=$2; shift 2
WHEELS=${WHEELS:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
  && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH || exit 1
[ -d .libaio ] && eval "$(baselines/libaio.sh env .libaio)"
export PYTHONUNBUFFERED=1
timeout --signal=INT --kill-after=30 "$limit" python3 -m snakemake --profile "$profile" "$@"
echo "snakemake exit $?"
hw=$(python3 -c "import yaml,sys; p=yaml.safe_load(open('profiles/$profile/config.yaml')); g=[c for c in p['config'] if c.startswith('grid=')][0][5:]; print(yaml.safe_load(open(g))['hardware'])")
tar czf "${OUT:-out}/workflow.tgz" $(ls -d "results/$hw" "plots/$hw" "logs/$hw" 2>/dev/null)
