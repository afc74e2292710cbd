"""Probe: one decoder layer's time in the engine's step against its single-layer ceiling.

The ceiling (Engine.layer_ceiling) runs a layer's forward, recompute and backward alone: weights
resident, nothing streamed, no host update beside it. In a step the same passes run beside both copy
streams and the CPU AdamW's threads. This builds a model of `--layers` layers (checkpoint_every 1,
`--accum` micro-batches a step), takes its last layer's ceiling (the layer one more depth adds: of
its own attention kind) and the device kernels of one ceiling under the profiler, then
trains warm-up steps and profiles one more: the timeline's forward, recompute and backward spans of
each layer in the last warm-up step (CUDA events on the compute stream, no profiler running) and
the device kernels of the profiled step (copies between host and device apart). Run at two
depths, the difference of the steps' kernels per layer added is a layer's own: against its spans
it says whether the layer's extra time in the step is in its kernels or between them; against the
ceiling's kernels (times the micro-batches), which kernels.

    python -m experiments.probes.step_kernels --preset qwen3-30b-a3b --layers 3 --out s3.json
    python -m experiments.probes.step_kernels --preset qwen3-30b-a3b --layers 6 --out s6.json
    python -m experiments.probes.step_kernels --compare s3.json s6.json

One process a depth: on a GPU host a closed trainer's host memory is not all given back
(layer_kernels.py). On the CPU (a check of the probe): --preset tiny-qwen2 --seq 64 --batch 2 --device cpu.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from experiments.probes.layer_kernels import kind
from megatrain.config import load_config
from megatrain.timeline import Kind, Track
from megatrain.trainer import Trainer

LAYER_PASSES = (Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD)
HOST_COPIES = ("HtoD", "DtoH", "Pinned", "Pageable")  # the copy streams' transfers, not the layers' work


def kernels(prof, cuda: bool, reps: int) -> dict:
    """Device (on the CPU, operator self) seconds per kind over `reps` repetitions, and the top 15."""
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or (not cuda and e.key.startswith("ProfilerStep")) or any(c in e.key for c in HOST_COPIES):
            continue
        totals[kind(e.key)] += us / reps
        top[e.key[:120]] += us / reps
    return {"seconds_by_kind": {k: v / 1e6 for k, v in sorted(totals.items())},
            "top_kernels": [{"name": k, "seconds": v / 1e6} for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]]}


def profiled(trainer: Trainer, work, reps: int = 1) -> dict:
    cuda = trainer.device.is_cuda
    activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        out = work()
        trainer.device.synchronize()
    return {"result": out, **kernels(prof, cuda, reps)}


def measure(args) -> dict:
    cfg = load_config(base={
        "model": {"preset": args.preset, "overrides": {"num_hidden_layers": args.layers}},
        "engine": {"device": args.device, "checkpoint_every": 1, **args.engine},
        "optim": {"lr": 1e-5},
        "data": {"source": "synthetic", "seq_len": args.seq, "batch_size": args.batch, "grad_accum": args.accum},
        "steps": args.warmup + 2})
    trainer = Trainer(cfg, progress=False)
    try:
        last = args.layers - 1
        ceiling = trainer.engine.layer_ceiling(args.batch, args.seq, reps=3, index=last)
        # the ceiling runs a warm-up repetition before its timed one: two under the profiler
        ceiling_kernels = profiled(trainer, lambda: trainer.engine.layer_ceiling(args.batch, args.seq, reps=1, index=last),
                                   reps=2)
        for _ in range(args.warmup):
            trainer.train_step(trainer.next_microbatches())
        spans = trainer.engine.timeline.spans(cut=False)  # the last warm-up step's: the profiler slows launches
        step = profiled(trainer, lambda: trainer.train_step(trainer.next_microbatches()))
    finally:
        trainer.close()
    passes: dict[str, float] = defaultdict(float)
    for s in spans:
        if s.track == Track.COMPUTE and s.kind in LAYER_PASSES:
            passes[s.kind.value] += s.end_s - s.start_s
    metrics = step.pop("result")
    return {"preset": args.preset, "layers": args.layers, "seq": args.seq, "batch": args.batch, "accum": args.accum,
            "engine": args.engine,
            "device": str(trainer.device.torch), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "ceiling": {**ceiling, **{k: v for k, v in ceiling_kernels.items() if k != "result"}},
            "step": {"step_s": metrics["step_time_s"], "exposed": metrics.get("exposed"),
                     "layer_pass_spans_s": dict(passes), **step}}


def compare(paths: list[str]) -> None:
    """Per layer added between two depths: the spans' and the kernels' seconds, beside the ceiling
    (the deeper run's last layer's, times the micro-batches)."""
    a, b = sorted((json.load(open(p)) for p in paths), key=lambda r: r["layers"])
    n = b["layers"] - a["layers"]
    if n <= 0:
        raise SystemExit("--compare needs two depths")
    mbs = b.get("accum", 1)

    def per_layer(get) -> float:
        return (get(b) - get(a)) / n * 1e3
    spans = per_layer(lambda r: sum(r["step"]["layer_pass_spans_s"].values()))
    print(f"{a['preset']} {a['engine']} {a['batch']} x {a['seq']} x {mbs}, layers {a['layers']} -> {b['layers']}, "
          f"ms a layer-step")
    print(f"  ceiling (alone):           {b['ceiling']['seconds'] * mbs * 1e3:7.1f}   its kernels "
          f"{sum(b['ceiling']['seconds_by_kind'].values()) * mbs * 1e3:7.1f}")
    print(f"  in the step, spans:        {spans:7.1f}   kernels per layer added "
          f"{per_layer(lambda r: sum(r['step']['seconds_by_kind'].values())):7.1f}")
    for k in sorted(b["step"]["seconds_by_kind"]):
        print(f"    {k:10s} step {per_layer(lambda r: r['step']['seconds_by_kind'].get(k, 0.0)):7.1f}"
              f"   ceiling {b['ceiling']['seconds_by_kind'].get(k, 0.0) * mbs * 1e3:7.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="sequences in a micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches a step")
    p.add_argument("--warmup", type=int, default=2, help="steps before the profiled one; the last one's spans are read")
    p.add_argument("--device", default="auto")
    p.add_argument("--engine", type=json.loads, default={}, help='engine settings as JSON, e.g. \'{"experts_kernel": "lean"}\'')
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar="JSON", help="two depths' results: the per-layer table")
    args = p.parse_args()
    if args.compare:
        return compare(args.compare)
    if not args.out or args.layers < 1 or args.warmup < 1 or args.accum < 1:
        p.error("--out, --layers >= 1, --accum >= 1 and --warmup >= 1 (or --compare A B)")
    result = measure(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.layers} layers: step {result['step']['step_s']:.3f} s, layer passes "
          f"{sum(result['step']['layer_pass_spans_s'].values()) * 1e3:.1f} ms, ceiling {result['ceiling']['seconds'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
