#!/usr/bin/env bash
# Ratel (baselines/ratel.md) on the GPU machine, from the carried checkout .ratel/LoHan and .libaio
# (device tool: carry [".ratel/LoHan", ".libaio"]; not ".ratel", which would replace the built ops):
#   experiments/ratel_gpu.sh build          probe the environment, build cpu_adam and async_io (once a machine)
#   experiments/ratel_gpu.sh disk OUT_DIR   one point offloaded to the VM's disk (a directory under /tmp)
#   experiments/ratel_gpu.sh cpu OUT_DIR    the same point offloaded to host memory
# The point: Ratel's GPT-2-style model at Qwen2.5-7B's width, 4 layers (1.17B parameters, half of them the
# embedding), main.py's input 1024 x 4, 1 + 3 of its 4 iterations. Made where the mirror is:
#   git clone /work/.mirror/RC4ML+LoHan/repo .ratel/LoHan   (or https://github.com/RC4ML/LoHan; 1.5 MB)
set -euo pipefail
export RATEL_HOME=${RATEL_HOME:-$PWD/.ratel/LoHan}
# the ops stay between calls of a warm machine (an ignored path that is not carried); ratel.py adds /ratel
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.ratel/torch_extensions}
[ -d .libaio ] && eval "$(baselines/libaio.sh env .libaio)"
SHAPE=(--preset qwen2.5-7b --layers 4 --seq 1024 --batch 4 --warmup 1 --steps 3)
case ${1:-} in
  build)
    python3 - <<'PY'
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
    ;;
  disk|cpu)
    out=${2:?usage: $0 disk|cpu OUT_DIR}
    mkdir -p "$out"
    python3 -m suite run --system ratel "${SHAPE[@]}" --timeout "${POINT_TIMEOUT:-560}" \
      --out "$out/ratel-$1.json" approximate_model=true offload="$1"
    python3 - "$out/ratel-$1.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["status"], r.get("reason") or "", (r.get("median") or {}).get("model_tflops"), "TFLOP/s")
print("\n".join(r.get("info", {}).get("compat", {}).get("applied", [])))
PY
    ;;
  *) echo "usage: $0 build | disk OUT_DIR | cpu OUT_DIR" >&2; exit 2 ;;
esac
