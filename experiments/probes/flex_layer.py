"""Probe: which operator copies a query-shaped tensor in GPT-OSS-20B's layer (one H200 GPU; the
layer's `--sites` named only the library's compiled flex attention): the engine's ceiling
(layer_kernels' experts_lean_gate, 8 x 4096 tokens), one profiled repetition, each copy or clone of
a 4-D tensor with a 4096 dimension with its whole Python stack and its CPU parents (an operator
under `CompiledFunctionBackward` ran in the backward). Which gradient layout makes flex attention's
backward copy: flex_tangent.py.

    python experiments/probes/flex_layer.py   # writes $OUT/flex_layer.json (OUT: the working directory if unset)"""
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

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

json.dump(report, open(os.path.join(OUT, "flex_layer.json"), "w"), indent=1)
