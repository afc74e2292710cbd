"""Probe: which operator copies a query-shaped tensor in GPT-OSS-20B's layer (one H200 GPU; the
layer's `--sites` named only the library's compiled flex attention). Part 1: the engine's ceiling
(layer_kernels' experts_lean_gate, 8 x 4096 tokens), one profiled repetition: each copy or clone of
a 4-D tensor with a 4096 dimension, with its whole Python stack and its CPU parents (an operator
under `CompiledFunctionBackward` ran in the backward). Part 2: the library's flex_attention_forward
alone, the engine's layout, under identity saved-tensor hooks or none, forward only (no-grad and
grad; the backward's copy is flex_tangent.py's).

    python experiments/probes/flex_layer.py   # writes $OUT/flex_layer.json (OUT: the working directory if unset)"""
import json
import os
import types

import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.profiler import ProfilerActivity, profile
from transformers.integrations.flex_attention import flex_attention_forward

from experiments.probes import layer_kernels as lk

OUT = os.environ.get("OUT", ".")
report = {}
verbose = torch._C._profiler._ExperimentalConfig(verbose=True)


def copies(prof, want=lambda s: len(s) == 4 and 4096 in s):
    rows = []
    for e in prof.events():
        if e.name in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::empty_like") \
                and e.input_shapes and e.input_shapes[0] and want(e.input_shapes[0]):
            parents, p = [], e.cpu_parent
            while p is not None and len(parents) < 12:
                parents.append(p.name[:90])
                p = p.cpu_parent
            rows.append({"op": e.name, "shapes": str(e.input_shapes)[:120], "parents": parents,
                         "stack": [s[-120:] for s in (e.stack or [])][:30], "device_us": e.device_time_total})
    return rows


class A:
    preset, seq, batch, reps, device, overrides = "gpt-oss-20b", 4096, 8, 1, "auto", {}


trainer = lk.Trainer(lk.config(A, lk.VARIANTS["experts_lean_gate"]), progress=False)
try:
    trainer.engine.layer_ceiling(8, 4096, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True,
                 experimental_config=verbose) as prof:
        trainer.engine.layer_ceiling(8, 4096, 1)
    report["layer"] = copies(prof)
finally:
    trainer.close()
print("LAYER", len(report["layer"]), "copies")
for c in report["layer"]:
    print(" ", c["op"], c["shapes"], round(c["device_us"]), "us")
    print("    parents:", " < ".join(c["parents"]))
    for s in c["stack"]:
        print("     ", s)

B, S, H, KV, D = 8, 4096, 64, 8, 64
mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cuda")
module = types.SimpleNamespace(training=True)
g = torch.Generator(device="cuda").manual_seed(0)


def mk(h):
    return torch.randn(B, S, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


base = [mk(H), mk(KV), mk(KV)]
for hooks in ("none", "identity"):
    for grad in (False, True):
        def step():
            q, k, v = (t.detach().requires_grad_(grad) for t in base)
            with (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks == "identity"
                  else torch.enable_grad()), torch.set_grad_enabled(grad):
                return flex_attention_forward(module, q, k, v, mask, scaling=0.125)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True,
                     experimental_config=verbose) as prof:
            step()
            torch.cuda.synchronize()
        key = f"bare_{hooks}_{'grad' if grad else 'nograd'}"
        report[key] = copies(prof)
        print(key, len(report[key]), "copies", [(c["op"], c["shapes"][:50], round(c["device_us"])) for c in report[key]])
json.dump(report, open(os.path.join(OUT, "flex_layer.json"), "w"), indent=1)
