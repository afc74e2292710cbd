#!/usr/bin/env bash
# A separate environment for the ColossalAI Gemini baseline, on a Linux x86-64 machine with internet,
# an NVIDIA GPU and a CUDA 12.x toolkit (nvcc; ColossalAI JIT-compiles its kernels with it and refuses
# a toolkit whose major version differs from torch's CUDA, 12.4 for torch 2.5.1). Not run here: the
# machine this was written on has no GPU and no internet access to the CUDA stack.
#
# torch stays inside colossalai's own range (<=2.5.1). transformers cannot: the suite imports
# transformers.masking_utils (not in colossalai's pinned 4.51.3), so transformers 5 (which accepts
# torch>=2.5) is installed and colossalai goes in with --no-deps. Gemini with tp_size 1 does not use
# ColossalAI's per-model transformers patches (shardformer), which is what that pin is for.
#
# Usage:  baselines/gemini-env.sh [VENV]        (default: .venv-gemini in the repository)
# Then:   python -m suite run --system gemini --python VENV/bin/python --preset ... --out ...
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$repo/.venv-gemini}
CAI=${COLOSSALAI_VERSION:-0.5.0}

nvcc_major=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
if [ "$nvcc_major" != 12 ]; then
  echo "need nvcc from a CUDA 12.x toolkit on PATH (found: ${nvcc_major:-none}); set CUDA_HOME to it" >&2
  exit 1
fi

python3 -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip
# PyPI's torch 2.5.1 for Linux is the CUDA 12.4 build. One resolve, so that nothing moves torch.
$pip install -q "torch==2.5.1" "transformers==5.17.*" ninja nvidia-ml-py \
  peft accelerate einops galore-torch bitsandbytes
$pip install -q --no-deps "colossalai==$CAI"  # its pins would pull transformers 4.51.3 back
$pip install -q -e "$repo"                      # megatrain and the suite's own dependencies

# The imports the suite's runner makes, then HybridAdam's kernels (JIT-built and cached in
# ~/.cache/colossalai), so that a broken toolchain shows up here and not in the first point.
"$venv/bin/python" - <<'EOF'
import torch, transformers, colossalai
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin
from colossalai.nn.optimizer import HybridAdam
print(f"colossalai {colossalai.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
if torch.cuda.is_available():
    HybridAdam([torch.nn.Parameter(torch.zeros(1))])
    print("HybridAdam kernels built")
else:
    print("no GPU visible: HybridAdam's kernels will be built at the first point")
EOF
echo "ready: python -m suite run --system gemini --python $venv/bin/python ..."
