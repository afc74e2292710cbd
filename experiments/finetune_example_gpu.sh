#!/usr/bin/env bash
# README's worked example of fine-tuning (configs/chat-sft-example.yaml) on a GPU machine without the
# Hub: the same run file, its model the Qwen2.5-7B-Instruct shape drawn at random (model.preset), its
# tokenizer a byte-level one with Qwen2.5's published chat template and special tokens
# (tests/tiny_tokenizer.py), since neither the checkpoint nor its tokenizer can be downloaded there.
# Runs README's three commands (data, plan, train), then its Python snippet (from_pretrained and
# generate) on the exported model; writes under ${OUT:-out}: the example, the plan, the metrics and
# a table last.
#   experiments/finetune_example_gpu.sh [PRESET] [extra settings ...]
# The 7B's saves need 98 GiB of disk (its training state 85, the model 14: the plan refuses a smaller
# disk); on the lent one-GPU H200's 64 GiB disk, PRESET qwen2.5-3b (40 GiB).
# On the CPU, a check of the script itself:
#   experiments/finetune_example_gpu.sh tiny-qwen2 model.overrides.vocab_size=512 \
#       model.overrides.max_position_embeddings=2048 epochs=1
set -uo pipefail
OUT=${OUT:-out}
PRESET=${1:-qwen2.5-7b}
shift $(( $# > 0 ? 1 : 0 ))
RUN=${RUN:-/tmp/finetune-example}
rm -rf "$RUN" && mkdir -p "$OUT" "$RUN"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "
import sys; sys.path.insert(0, 'tests')
from tiny_tokenizer import byte_tokenizer
byte_tokenizer('qwen2.5').save_pretrained('$RUN/tokenizer')" || exit 1
ARGS=(--config configs/chat-sft-example.yaml model.pretrained=null "model.preset=$PRESET"
      "data.tokenizer=$RUN/tokenizer" "output_dir=$RUN/chat-sft" "$@")
python3 -m megatrain.cli data "${ARGS[@]}" --example 0 > "$OUT/example.txt" 2>&1; echo "data rc=$?"
python3 -m megatrain.cli plan "${ARGS[@]}" > "$OUT/plan.txt" 2>&1; echo "plan rc=$?"
python3 -m megatrain.cli train --no-progress "${ARGS[@]}" > "$OUT/train.txt" 2>&1; echo "train rc=$?"
cp "$RUN/chat-sft/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
python3 - "$RUN/chat-sft/model" > "$OUT/generate.txt" 2>&1 <<'PY'; echo "generate rc=$?"
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
device = "cuda" if torch.cuda.is_available() else "cpu"
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to(device)
inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True, return_tensors="pt", return_dict=True).to(model.device)
out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
print(repr(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)))
PY
tail -n 3 "$OUT/plan.txt" "$OUT/train.txt" "$OUT/generate.txt"
python3 - "$OUT/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if len(sys.argv) > 1 else []
evals = {m["step"]: m for m in rows if m.get("kind") == "eval"}
print(f"{'step':>4} {'loss':>8} {'eval':>8} {'acc':>6} {'time s':>7} {'TFLOP/s':>8} {'dev GiB':>8} {'host GiB':>8}")
for m in rows:
    if m.get("kind") != "train":
        continue
    e = evals.get(m["step"], {})
    print(f"{m['step']:4d} {m['loss']:8.4f} {e.get('eval_loss', float('nan')):8.4f} {e.get('eval_accuracy', float('nan')):6.3f} {m['step_time_s']:7.2f} "
          f"{m['model_tflops']:8.1f} {(m.get('peak_device_allocated_bytes') or 0) / 2**30:8.1f} "
          f"{m['peak_host_bytes'] / 2**30:8.1f}")
PY
