"""Probe: whether a decoder layer's single-layer ceiling (Engine.layer_ceiling) waits on the host
that launches it. Per phase of the ceiling (the forward without grad, the recompute with its graph,
the backward), on the same micro-batch and weights:

- gpu_ms: the compute stream's span of the phase, from an event before it to one after it, the
  phases back to back as the ceiling runs them (the GPU idle at the start, as there);
- host_ms: the launching thread's time to issue the phase while the GPU is held back by a sleep
  kernel queued first, so that no launch waits for the device: what the host alone costs.
  `overran_sleep` says whether the GPU finished the sleep before the host finished issuing (then a
  launch may have waited and host_ms is a bound from above);
- host_ops: the host's operators and compiled regions (torch.compile's cache lookups among them) by
  their own time over one more stalled repetition of the three phases, the largest first.

A phase whose host_ms is near its gpu_ms is bound by its launches: the GPU idles between kernels
while the host issues them (the ceiling's time beyond the sum of its kernels, layer_kernels.py).
Medians of --reps repetitions after a warm-up.

    python -m experiments.probes.layer_host --preset gpt-oss-20b --layer 0 --out layer_host.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from experiments.probes.layer_kernels import VARIANTS, config
from megatrain.batch import Batch
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.trainer import Trainer

PHASES = ("forward", "recompute", "backward")
TOP = 30  # host operators listed
SLEEP_CYCLES = 1_000_000_000  # about half a second at an H200's clock: longer than any phase's issuing


def measure(engine, index: int, batch: int, seq: int, reps: int) -> dict:
    dev, unit = engine.dev, engine.layer_units[index]
    engine.optimizer.flush()
    engine.timeline.begin_step()
    engine.streamer.start([unit])
    w = engine.streamer.acquire()
    gen = torch.Generator(device=dev.torch).manual_seed(0)
    shape = (batch, seq, engine.shape.hidden)
    x0 = torch.randn(shape, generator=gen, device=dev.torch, dtype=engine.dtype)
    dy = torch.randn(shape, generator=gen, device=dev.torch, dtype=engine.dtype)
    ctx = engine._context(x0, Batch(torch.empty(batch, seq, dtype=torch.long), None))
    root_only = engine.s.checkpoint_every == 1
    state = {}

    def forward():
        with torch.no_grad():
            engine._layer(index, w, x0, ctx)

    def recompute():
        state["graph"] = engine._graph(index, w, x0, ctx, root_only=root_only)

    def backward():
        x, leaves, out, _ = state.pop("graph")
        torch.autograd.grad(out, [x, *leaves], dy)

    rows = {name: {"gpu_ms": [], "host_ms": []} for name in PHASES}
    overran = []
    with dev.on(dev.compute):
        for rep in range(reps + 1):
            dev.synchronize()  # the ceiling's way: the phases back to back from an idle GPU
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
            events[0].record()
            for event, phase in zip(events[1:], (forward, recompute, backward)):
                phase()
                event.record()
            dev.synchronize()
            gpu = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
            torch.cuda._sleep(SLEEP_CYCLES)  # the GPU held back: each launch returns without waiting
            host = []
            for phase in (forward, recompute, backward):
                start = time.perf_counter()
                phase()
                host.append((time.perf_counter() - start) * 1e3)
            overran.append(torch.cuda.current_stream().query())  # True: the GPU caught up with the host
            dev.synchronize()
            if rep:
                for name, g, h in zip(PHASES, gpu, host):
                    rows[name]["gpu_ms"].append(g)
                    rows[name]["host_ms"].append(h)
        # the host's operators and compiled regions by their own time, one more stalled repetition
        dev.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for phase in (forward, recompute, backward):
                phase()
        dev.synchronize()
    engine.streamer.release()
    out = {name: {k: statistics.median(v) for k, v in row.items()} | {"samples": row} for name, row in rows.items()}
    out["overran_sleep"] = any(overran[1:])
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP]
    out["host_ops"] = [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--variant", default=None, choices=list(VARIANTS),
                   help="the layer's kernels (layer_kernels' variants); default experts_lean_gate for a mixture of "
                        "experts, both for a dense model")
    p.add_argument("--overrides", type=json.loads, default={})
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("layer_host measures a CUDA GPU's launches: no GPU here")
    experts = ModelShape(load_hf_config(config(args, {}).model)).experts
    variant = args.variant or ("experts_lean_gate" if experts else "both")
    trainer = Trainer(config(args, VARIANTS[variant]), progress=False)
    try:
        phases = measure(trainer.engine, args.layer, args.batch, args.seq, args.reps)
    finally:
        trainer.close()
    result = {"preset": args.preset, "layer": args.layer, "seq": args.seq, "batch": args.batch, "variant": variant,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": phases}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name in PHASES:
        row = phases[name]
        print(f"{args.preset} L{args.layer} {name:9s} gpu {row['gpu_ms']:7.2f} ms  host {row['host_ms']:7.2f} ms")
    print(f"overran the sleep: {phases['overran_sleep']}")
    for op in phases["host_ops"][:12]:
        print(f"  {op['self_ms']:7.2f} ms {op['calls']:5d}x {op['name']}")


if __name__ == "__main__":
    main()
