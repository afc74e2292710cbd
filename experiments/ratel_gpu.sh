#!/usr/bin/env bash
# Ratel's dry check on the GPU machine (baselines/ratel.md), in one call: the environment probe, the
# build of its two ops (timed), then main.py at a smoke shape (Qwen2.5-0.5B's width, 2 layers, input
# 256 x 4) offloaded to the VM's disk and to host memory. Needs the carried checkout and libaio
# (device tool: carry [".ratel", ".libaio"]), made where there is internet:
#   git clone https://github.com/RC4ML/LoHan .ratel/LoHan      (1.5 MB; .ratel/ is git-ignored)
#   baselines/libaio.sh fetch .libaio
#   OUT=out experiments/ratel_gpu.sh
# The measured points are the grids' `ratel` experiment (h100.yaml, gh200.yaml): 1b_ratel_disk, 1b_ratel_cpu.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export RATEL_HOME=${RATEL_HOME:-$PWD/.ratel/LoHan}
[ -d .libaio ] && eval "$(baselines/libaio.sh env .libaio)"
python3 - <<'PY' || exit 1
import os, subprocess, sys, time
from pathlib import Path
from baselines.ratel import compat_env
from baselines.ratel_compat import PATH
env = compat_env(Path(os.environ["RATEL_HOME"]).resolve())
subprocess.run([sys.executable, str(PATH / "ratel_probe.py")], env=env, check=True, cwd="/tmp")
build = ("from op_ds.ops.op_builder.async_io import AsyncIOBuilder\n"
         "from op_ds.ops.op_builder.CPUAdamBuilder import CPUAdamBuilder\n"
         "AsyncIOBuilder().load(verbose=True); CPUAdamBuilder().load(verbose=True)\n")
start = time.time()
subprocess.run([sys.executable, "-c", build], env=env, check=True, cwd="/tmp")
print(f"ratel ops built in {time.time() - start:.0f} s under {env['TORCH_EXTENSIONS_DIR']}")
PY
for offload in disk cpu; do
  python3 -m suite run --system ratel --preset qwen2.5-0.5b --layers 2 --seq 256 --batch 4 --warmup 1 --steps 3 \
    --timeout 240 --out "$OUT/ratel-smoke-$offload.json" approximate_model=true offload=$offload
  python3 - "$OUT/ratel-smoke-$offload.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["status"], r.get("reason") or "", [s.get("step_time_s") for s in r.get("steps", [])])
print("\n".join(r.get("info", {}).get("compat", {}).get("applied", [])))
print((r.get("info", {}).get("output_tail") or r.get("log_tail") or "")[-1500:])
PY
done
