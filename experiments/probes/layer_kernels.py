"""Probe: where one decoder layer's time goes (issue 24's first measurement), on the engine's own
single-layer ceiling (Engine.layer_ceiling: forward, recompute and backward of one micro-batch,
weights resident, the step's saved-tensor hooks).

For each SDPA backend that runs at the shape (torch.nn.attention.sdpa_kernel; `default` is torch's
own choice; `--backends` names which, under the first variant) the ceiling's seconds and model
TFLOP/s; then, under the default, one profiled ceiling
whose device kernels are summed by kind: matrix products, attention, and the rest (norms, rotary,
SwiGLU, residuals, casts, copies): the bound on what fusing the elementwise chain can give. The
default ceiling and the breakdown again with the compiled kernels (`--variants`: the norms',
engine.norm_kernel; the MLP's product, engine.mlp_kernel; both), or for a mixture of experts the
library's experts against the lean ones (experts_library, experts_lean: engine.experts_kernel) and
the lean ones with their gate compiled (experts_lean_gate: engine.mlp_kernel). With --sites, each
variant's time outside the matrix products and attention also by operator, its input shapes and its
Python call site (one more profiled repetition, with stacks). --layer picks the layer (its attention's
kind where the model's layers differ: GPT-OSS's layer 1 attends to every token before, layer 0 to a
window).

    python -m experiments.probes.layer_kernels --preset qwen2.5-7b --batch 8 --seq 4096 --out layer.json

On the CPU (a check of the probe itself): --preset tiny-qwen2 --seq 64 --batch 2 --device cpu.
At long context, the attention kernels alone (the math backend's square does not fit), e.g. the
7B layer at 512K tokens: --seq 524288 --batch 1 --reps 1 --variants both --backends flash,cudnn
--overrides '{"max_position_embeddings": 524288}'.
Each variant builds its own trainer in this process. On a GPU host the earlier trainers' host memory
is not all given back (GPT-OSS-20B's layer: 69 GiB at the peak alone, 119 GiB for two variants in one
process, results/h200/probes/layer_probe_exits.txt; the CPU gives it back), and past the host's memory
the kernel kills the process without a word: give a large model's variants a process each there.
Each trainer is closed, dropped and collected before the next, and `pinned_after_drop` records the
pinned host memory left then.
"""
from __future__ import annotations

import argparse
import gc
import json
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatrain.config import load_config
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.trainer import Trainer

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
MATMUL = ("gemm", "nvjet", "xmma", "cutlass", "matmul", "::mm", "addmm", "bmm")
# flex attention (GPT-OSS's sinks and windows) runs as Triton template kernels (`triton_tem_...`); the
# engine's other compiled kernels (norms, the MLP's product, the loss) are pointwise and reductions
TOP = 40  # kernels listed by their time, each with its calls a repetition
ATTENTION = ("flash", "fmha", "attention", "cudnn", "sdpa", "triton_tem")


def kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ATTENTION):
        return "attention"
    if any(k in low for k in MATMUL):
        return "matmul"
    return "other"


def kernel_breakdown(trainer: Trainer, batch: int, seq: int, index: int = 0) -> dict:
    """Device (or, on the CPU, operator self) time per kind over one ceiling repetition."""
    cuda = trainer.device.is_cuda
    activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        trainer.engine.layer_ceiling(batch, seq, reps=1, index=index)
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or (not cuda and e.key.startswith("ProfilerStep")):
            continue
        totals[kind(e.key)] += us
        top[e.key] += us
        calls[e.key] += e.count
    # two repetitions ran (the ceiling's warm-up and one timed): halve to one
    return {"seconds_by_kind": {k: v / 2e6 for k, v in sorted(totals.items())},
            "top_kernels": [{"name": k[:160], "seconds": v / 2e6, "calls": calls[k] // 2}
                            for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:TOP]]}


MATMUL_OPS = ("mm", "linear", "matmul", "attention", "flex")  # operators of the matmul and attention kinds
SITE_FRAMES = ("megatrain/", "transformers/", "torch/nn/functional", "torch/_higher_order_ops")  # the frames named


def call_sites(trainer: Trainer, batch: int, seq: int, index: int = 0, matmuls: bool = False) -> list[dict]:
    """The device time of one ceiling repetition by the operator that launched it, its input
    shapes and its Python call site (its innermost frames in the engine or the library); for the
    backward's operators, which autograd's thread runs without a Python stack, the autograd node
    whose backward ran them (`autograd: CloneBackward0`: the forward operator's gradient). The matrix
    products and attention left out: where the rest of the layer's time is spent, op by op; or, with
    `matmuls`, they alone: each product's time by its shapes."""
    cuda = trainer.device.is_cuda
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python stacks: with_stack alone records none
    with torch.profiler.profile(activities=activities, with_stack=True, record_shapes=True, experimental_config=stacks) as prof:
        trainer.engine.layer_ceiling(batch, seq, reps=1, index=index)
    sites: dict[tuple, dict] = {}
    for e in prof.events():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or not e.name.startswith("aten::") or any(k in e.name for k in MATMUL_OPS) != matmuls:
            continue
        frames = [f for f in e.stack if any(k in f for k in SITE_FRAMES)][:3] or _autograd_node(e)
        row = sites.setdefault((e.name, str(e.input_shapes)[:160], tuple(frames)), {
            "op": e.name, "shapes": str(e.input_shapes)[:160], "site": frames, "seconds": 0.0, "calls": 0})
        row["seconds"] += us / 2e6  # two repetitions ran: halved to one
        row["calls"] += 1
    for row in sites.values():
        row["calls"] //= 2
    return sorted(sites.values(), key=lambda r: -r["seconds"])[:TOP]


def _autograd_node(event) -> list[str]:
    """The autograd node whose backward ran `event` (its innermost enclosing one), or none."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(AUTOGRAD):
        parent = parent.cpu_parent
    return [] if parent is None else ["autograd: " + parent.name[len(AUTOGRAD):].strip()]


AUTOGRAD = "autograd::engine::evaluate_function:"


VARIANTS = {"eager": {"norm_kernel": "eager", "mlp_kernel": "eager"},
            "both": {"norm_kernel": "compiled", "mlp_kernel": "compiled"},
            "norm": {"norm_kernel": "compiled", "mlp_kernel": "eager"},
            "mlp": {"norm_kernel": "eager", "mlp_kernel": "compiled"},
            # a mixture of experts' layer, the norms compiled (the GPU's default): the library's experts
            # against the lean ones (engine.experts_kernel)
            "experts_library": {"norm_kernel": "compiled", "mlp_kernel": "eager", "experts_kernel": "library"},
            "experts_lean": {"norm_kernel": "compiled", "mlp_kernel": "eager", "experts_kernel": "lean"},
            "experts_lean_gate": {"norm_kernel": "compiled", "mlp_kernel": "compiled", "experts_kernel": "lean"}}


def config(args, kernels: dict):
    """The model's layers up to the one measured (`--layer`), built with `kernels`
    (engine.norm_kernel, engine.mlp_kernel, engine.experts_kernel)."""
    return load_config(base={
        "model": {"preset": args.preset, "overrides": {"num_hidden_layers": args.layer + 1, **args.overrides}},
        # the eager host AdamW: the ceiling runs no optimizer step, and the compiled one's build costs
        # tens of seconds a process on the GPU hosts' torch
        "engine": {"device": args.device, "checkpoint_every": 1, "optimizer_kernel": "eager", **kernels},
        "optim": {"lr": 1e-5},
        "data": {"source": "synthetic", "seq_len": args.seq, "batch_size": args.batch}, "steps": 1})


def measure(args, kernels: dict, backends: list[str] | None, sites: bool = False, matmul_sites: bool = False) -> dict:
    """The ceilings and the kernel breakdown of one layer built with `kernels`; for the first variant
    (`backends` not None) also each SDPA backend's of `backends` and, where the layer can keep its
    attention (on a GPU), the ceiling of the layer that does (keep_attention)."""
    trainer = Trainer(config(args, kernels), progress=False)
    rows = {}
    try:
        rows["default"] = trainer.engine.layer_ceiling(args.batch, args.seq, args.reps, index=args.layer)
        if backends is not None and trainer.settings.keep_attention_layers:  # the policy's ceiling too
            rows["keep_attention"] = trainer.engine.layer_ceiling(args.batch, args.seq, args.reps, keep_attention=True,
                                                                 index=args.layer)
        for name in backends or []:
            try:
                with sdpa_kernel([BACKENDS[name]]):
                    rows[name] = trainer.engine.layer_ceiling(args.batch, args.seq, args.reps, index=args.layer)
            except RuntimeError as e:  # no kernel of that backend for this shape, dtype or device
                rows[name] = {"error": str(e).splitlines()[0][:200]}
        breakdown = kernel_breakdown(trainer, args.batch, args.seq, args.layer)
        if sites:
            breakdown["call_sites"] = call_sites(trainer, args.batch, args.seq, args.layer)
        if matmul_sites:
            breakdown["matmul_sites"] = call_sites(trainer, args.batch, args.seq, args.layer, matmuls=True)
    finally:
        trainer.close()
    device = str(trainer.device.torch)
    # the pinned host memory left once the trainer is closed and dropped, before the next variant's
    # trainer (read while the trainer is still held, it would count the closed trainer's live buffers)
    del trainer
    gc.collect()
    pinned = {k: v for k, v in torch.cuda.host_memory_stats().items() if k.endswith("bytes.current")}
    return {"device": device, "ceilings": rows, "pinned_after_drop": pinned, **breakdown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="sequences in the micro-batch")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layer", type=int, default=0,
                   help="the layer measured, the model built with as many before it (its type: GPT-OSS's layer 0 "
                        "attends to a 128-token window, layer 1 to all tokens before)")
    p.add_argument("--device", default="auto")
    p.add_argument("--variants", default="auto",
                   help=f"comma-separated, of {list(VARIANTS)} (the compiled norms, the compiled MLP product, both; "
                        "a mixture of experts' experts, the library's, lean, lean with the gate compiled); "
                        "auto: the experts' three for a mixture of experts, the other four for a dense model")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, of {list(BACKENDS)}, each timed alone under the first variant; "
                        "none: '' (at long context the math backend's square does not fit)")
    p.add_argument("--overrides", type=json.loads, default={},
                   help='the model config\'s overrides beside one layer, as JSON, e.g. \'{"max_position_embeddings": 524288}\'')
    p.add_argument("--sites", action="store_true",
                   help="also each variant's non-matmul, non-attention time by operator and call site (a profile with stacks)")
    p.add_argument("--matmul-sites", action="store_true",
                   help="also each variant's matrix products and attention by operator, input shapes and call site")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if args.layer < 0:
        p.error(f"--layer {args.layer}: a layer's index is 0 or more")
    try:
        experts = ModelShape(load_hf_config(config(args, {}).model)).experts
    except (KeyError, ValueError) as e:  # an unknown preset, a bad override
        p.error(str(e))
    moe = [v for v in VARIANTS if v.startswith("experts_")]
    variants = (moe if experts else [v for v in VARIANTS if v not in moe]) if args.variants == "auto" \
        else args.variants.split(",")
    unknown = sorted(set(backends) - set(BACKENDS)) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown backends or variants: {unknown}")
    if not experts and set(variants) & set(moe):
        p.error(f"{args.preset} has no experts: the variants {moe} are for a mixture of experts")
    runs = {}
    result = {"preset": args.preset, "layer": args.layer, "seq": args.seq, "batch": args.batch,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "torch": torch.__version__, "variants": runs}
    for i, v in enumerate(variants):  # written after each: a run cut short keeps what it measured
        runs[v] = measure(args, VARIANTS[v], backends if i == 0 else None, args.sites, args.matmul_sites)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for kernel, run in runs.items():
        for name, row in run["ceilings"].items():
            print(f"{kernel:6s} sdpa {name:10s} " + (
                f"{row['seconds'] * 1e3:8.1f} ms  {row['model_tflops']:6.1f} model TFLOP/s"
                if "seconds" in row else row["error"]))
        total = sum(run["seconds_by_kind"].values())
        for k, sec in run["seconds_by_kind"].items():
            print(f"{kernel:6s} {k:15s} {sec * 1e3:8.1f} ms  {sec / total:5.1%}")
        for site in run.get("call_sites", [])[:15] + run.get("matmul_sites", [])[:15]:
            print(f"{kernel:6s} {site['seconds'] * 1e3:6.2f} ms {site['calls']:3d}x {site['op']:28s} "
                  f"{site['shapes'][:60]:60s} {' < '.join(f.split('/')[-1] for f in site['site'][:2])}")


if __name__ == "__main__":
    main()
