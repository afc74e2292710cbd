"""Probe: when the backward of the library's compiled flex attention copies its output's gradient
(one H200 GPU, GPT-OSS-20B's attention shape, 8 x 4096 tokens; flex_layer.py found the copy in the
layer's backward). One case a process:
  bshd         the gradient as the engine gives it: (B, H, S, D) over (B, S, H, D) memory, the output's own layout
  bhsd         the gradient (B, H, S, D)-contiguous
  static_bshd  bshd with torch._dynamo.config.automatic_dynamic_shapes = False
Each: a no-grad forward, then two forward-backward (as the engine's forward and recompute), the second profiled: the
backward's copies of 4-D tensors and their device time, and the compile settings read.

    python experiments/probes/flex_tangent.py bshd   # writes $OUT/flex_tangent_bshd.json"""
import json
import os
import sys
import types

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.flex_attention import flex_attention_forward

case = sys.argv[1]
if case == "static_bshd":
    torch._dynamo.config.automatic_dynamic_shapes = False

B, S, H, KV, D = 8, 4096, 64, 8, 64
mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cuda")
module = types.SimpleNamespace(training=True)
g = torch.Generator(device="cuda").manual_seed(0)


def mk(h):
    return torch.randn(B, S, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


base = [mk(H), mk(KV), mk(KV)]
grad_bshd = torch.randn(B, S, H, D, generator=g, device="cuda", dtype=torch.bfloat16)  # the library's output's layout
grad_bhsd = grad_bshd.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, H, S, D) memory


def step(grad=True):
    q, k, v = (t.detach().requires_grad_(grad) for t in base)
    with torch.set_grad_enabled(grad):
        out, lse = flex_attention_forward(module, q, k, v, mask, scaling=0.125)  # out (B, S, H, D)
        if grad:
            out.backward(grad_bhsd if case == "bhsd" else grad_bshd)
    return out


step(False)
step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    out = step()
    torch.cuda.synchronize()
rows = []
for e in prof.events():
    if e.name in ("aten::contiguous", "aten::copy_") and e.input_shapes and e.input_shapes[0] and len(e.input_shapes[0]) >= 3:
        rows.append({"op": e.name, "shapes": str(e.input_shapes)[:80], "device_us": round(e.device_time_total, 1)})
flex_us = sum(e.device_time_total for e in prof.events() if e.name.startswith("triton_tem"))
report = {"case": case, "torch": torch.__version__, "out_stride": list(out.stride()),
          "guess_tangent_strides_as_outputs": torch._functorch.config.guess_tangent_strides_as_outputs,
          "automatic_dynamic_shapes": torch._dynamo.config.automatic_dynamic_shapes,
          "copies": rows, "flex_kernels_us": round(flex_us, 1)}
print(json.dumps(report))
with open(os.path.join(os.environ.get("OUT", "."), f"flex_tangent_{case}.json"), "w") as f:
    json.dump(report, f, indent=1)
