#!/usr/bin/env bash
# Ran in session 48 on `nvidia-h200` at d30a3ac (160 s wall); its three JSON files lie beside it.
# The compiled norms and MLP product against the eager ones in one dense layer (Engine.layer_ceiling)
# on one H200, at two widths and two lengths, carrying [".whl"]: what the step model needs to time a
# run with the compiled kernels (suite/projection.py times every layer at the eager probe's rate, and
# its dense GPU-bound points with the compiled kernels came out at a median +7.8% step error against
# -6.2% for the eager ones). Prediction: the 7B layer eager about 425 model TFLOP/s (the H100's 423.8),
# compiled 492 (session 47's 492.0), so the compiled kernels save 13-16 ms of the layer's
# forward, recompute and backward at 8 x 4096; at 14B about 0.75 of that a token (the gated MLP's
# elementwise work scales with the intermediate width, 13824 against 18944); at 1 x 32768 tokens
# the same saving as at 8 x 4096 (the saved kernels are a token's, not attention's).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
probe() {  # name preset batch seq
  timeout $((${5:-100})) python3 -m experiments.probes.layer_kernels --preset $2 --batch $3 --seq $4 \
    --variants eager,both --backends '' --out $OUT/$1.json 2>&1 | grep -v Warn | tail -3
}
probe 7b qwen2.5-7b 8 4096
probe 14b qwen2.5-14b 8 4096
probe 7b_32k qwen2.5-7b 1 32768
python3 - $OUT <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    v = json.loads(f.read_text())["variants"]
    e, b = (v[k]["ceilings"]["default"] for k in ("eager", "both"))
    print(f"{f.stem:8s} eager {e['model_tflops']:6.1f} ({1e3 * e['seconds']:6.1f} ms)  compiled {b['model_tflops']:6.1f} "
          f"({1e3 * b['seconds']:6.1f} ms)  saved {1e3 * (e['seconds'] - b['seconds']):5.1f} ms")
PY
