#!/usr/bin/env bash
# The engine issue's GPU evidence in one call: GPU tests, Qwen2.5-3B shape for 10 steps at
# sequence 4096, and the 7B shape (float32 masters with clipping: 18 B/param whole, over a 126 GiB host, so
# engine.split_masters auto splits them, 16 B/param: a plan of 123.5 GiB, at the edge of the host, admitted or
# refused against what the OS reports; bf16 masters: a few steps). Writes under ${OUT:-out}; prints a table last.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q tests 2>&1 | tail -5 | tee "$OUT/pytest.txt"
run() {  # name, timeout, overrides...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m megatrain.cli train --no-progress "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
    echo "$name rc=$?" >> "$OUT/status.txt"
}
run qwen2.5-3b_seq4096_bs4 300 --config configs/qwen2.5-3b-gpu.yaml
run qwen2.5-7b_fp32master 60 --config configs/qwen2.5-3b-gpu.yaml model.preset=qwen2.5-7b
run qwen2.5-7b_bf16master_seq4096_bs4 280 --config configs/qwen2.5-3b-gpu.yaml model.preset=qwen2.5-7b \
    engine.master_dtype=bfloat16 steps=4
cat "$OUT/status.txt"; grep -h "error" "$OUT"/*.err | cut -c1-400
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':38} {'step':>4} {'loss':>8} {'time s':>7} {'TFLOP/s':>8} {'dev GiB':>8} {'host GiB':>8} {'opt s':>6} {'w_upd':>6} {'w_slab':>6}")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    for line in f.read_text().splitlines():
        m = json.loads(line)
        print(f"{f.stem:38} {m['step']:4d} {m['loss']:8.4f} {m['step_time_s']:7.2f} {m['model_tflops']:8.1f} "
              f"{(m['peak_device_allocated_bytes'] or 0) / 2**30:8.1f} {m['peak_host_bytes'] / 2**30:8.1f} "
              f"{m['optimizer_busy_s']:6.2f} {m['wait_update_s']:6.2f} {m['wait_slab_s']:6.2f}")
PY
