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
  their own time over one more stalled repetition of the three phases, the largest first;
- idle: one more repetition as the ceiling runs it, traced: the GPU's busy time against its span
  and its idle gaps, each with the kernels around it, the operator and phase that launched the
  kernel after, and whether that launch came late (the host's gap) or in time (the device's);
- ways: one repetition's time measured four ways, medians: `ceiling_ms` Engine.layer_ceiling's own
  (the host's clock from a synchronize to the next), `synced_ms` the GPU's span of the three phases
  from an event recorded on the idle GPU (as gpu_ms), `queued_ms` the GPU's time per repetition with
  the repetitions issued back to back and no synchronize between them, as a step issues its layers
  (the host ahead of the GPU from the second on), and `kernels_ms` the traced repetition's busy time.
  ceiling - synced is the host's time around the GPU's span (its first launch, the synchronize's
  return), synced - queued the GPU's idle while the host catches up after a synchronize, queued -
  kernels the GPU's idle between kernels that no lead of the host removes.

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
from typing import NamedTuple

import torch

from experiments.probes.layer_kernels import VARIANTS, config
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.trainer import Trainer

PHASES = ("forward", "recompute", "backward")
TOP = 30  # host operators and idle gaps listed
GAP_US = 20.0  # the GPU idle longer than this between two kernels is a gap
SLEEP_CYCLES = 1_000_000_000  # about half a second at an H200's clock: longer than any phase's issuing


def measure(engine, index: int, batch: int, seq: int, reps: int) -> dict:
    with engine.ceiling_inputs(batch, seq, index) as (w, x0, dy, ctx):
        dev = engine.dev
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
            # one more repetition as the ceiling runs it (from an idle GPU), its kernels and launches traced
            dev.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as traced:
                for name, phase in zip(PHASES, (forward, recompute, backward)):
                    with torch.profiler.record_function(f"phase:{name}"):
                        phase()
                dev.synchronize()
            # the repetitions back to back, no synchronize between them: an event before each, the
            # first repetition (from an idle GPU) left out
            dev.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 2)]
            for mark in marks[:-1]:
                mark.record()
                for phase in (forward, recompute, backward):
                    phase()
            marks[-1].record()
            dev.synchronize()
            queued = [a.elapsed_time(b) for a, b in zip(marks[1:], marks[2:])]
        out = {name: {k: statistics.median(v) for k, v in row.items()} | {"samples": row} for name, row in rows.items()}
        synced = [sum(rows[name]["gpu_ms"][rep] for name in PHASES) for rep in range(reps)]
        out["queued"] = {"samples_ms": queued, "synced_samples_ms": synced}
        out["overran_sleep"] = any(overran[1:])
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP]
        out["host_ops"] = [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in ops]
        out["idle"] = idle_gaps(traced.profiler.kineto_results.events())
        return out


class Event(NamedTuple):
    """One profiler event, from the kineto results (their API is the same across torch releases)."""
    name: str
    device_type: object
    start: float  # microseconds
    end: float
    id: int
    linked: int  # the correlation id of the operator that launched it; 0 for an operator


def idle_gaps(events) -> dict:
    """The GPU's idle time in a traced repetition: the span from its first kernel (or copy) to its
    last, the time some kernel ran, and each gap of more than GAP_US between them, the largest
    first: the kernels on either side, the operator that launched the one after, the phase whose
    host time the launch fell in, and when the launch call began against the end of the kernel
    before (`launched_after_idle_us` > 0: the host launched it only once the GPU had gone idle, so
    the gap is the host's; <= 0: launched in time, so the gap is the device's, a wait on another
    stream or event)."""
    from torch.autograd import DeviceType
    events = [Event(e.name(), e.device_type(), e.start_ns() / 1e3, e.end_ns() / 1e3, e.correlation_id(),
                    e.linked_correlation_id()) for e in events]
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.start)
    if not device:
        return {"span_us": 0.0, "busy_us": 0.0, "gaps": []}
    ops = {e.id: e.name for e in events if e.device_type == DeviceType.CPU and e.linked == 0}
    launches = {e.linked: e for e in events if e.device_type == DeviceType.CPU and e.linked > 0}
    phases = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("phase:")]
    busy, gaps = 0.0, []
    end, before = device[0].start, None
    for k in device:
        start, stop = k.start, k.end
        if before is not None and start - end > GAP_US:
            launch = launches.get(k.linked)
            at = launch.start if launch else None
            phase = next((p.name[6:] for p in phases if at is not None and p.start <= at <= p.end),
                         None)
            gaps.append({"gap_us": start - end, "at_us": start - device[0].start, "before": before[:100],
                         "after": k.name[:100], "after_op": ops.get(k.linked), "phase": phase,
                         "launched_after_idle_us": None if at is None else at - end})
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, k.name
    gaps.sort(key=lambda g: -g["gap_us"])
    return {"span_us": end - device[0].start, "busy_us": busy,
            "in_gaps_us": sum(g["gap_us"] for g in gaps), "gaps": gaps[:TOP]}


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
        ceiling = trainer.engine.layer_ceiling(args.batch, args.seq, args.reps, index=args.layer)
    finally:
        trainer.close()
    phases["ways"] = {"ceiling_ms": ceiling["seconds"] * 1e3,
                      "synced_ms": statistics.median(phases["queued"]["synced_samples_ms"]),
                      "queued_ms": statistics.median(phases["queued"]["samples_ms"]),
                      "kernels_ms": phases["idle"]["busy_us"] / 1e3}
    result = {"preset": args.preset, "layer": args.layer, "seq": args.seq, "batch": args.batch, "variant": variant,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": phases}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name in PHASES:
        row = phases[name]
        print(f"{args.preset} L{args.layer} {name:9s} gpu {row['gpu_ms']:7.2f} ms  host {row['host_ms']:7.2f} ms")
    print(f"overran the sleep: {phases['overran_sleep']}")
    idle = phases["idle"]
    print(f"traced: span {idle['span_us'] / 1e3:.2f} ms, busy {idle['busy_us'] / 1e3:.2f}, "
          f"in gaps over {GAP_US:.0f} us {idle.get('in_gaps_us', 0.0) / 1e3:.2f}")
    for g in idle["gaps"][:12]:
        late = "" if g["launched_after_idle_us"] is None else f" launched {g['launched_after_idle_us']:+.0f} us"
        print(f"  gap {g['gap_us']:7.1f} us {g['phase'] or '?':9s} before {g['after'][:40]} ({g['after_op']}){late}")
    print("one repetition, ms: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in phases["ways"].items()))
    for op in phases["host_ops"][:12]:
        print(f"  {op['self_ms']:7.2f} ms {op['calls']:5d}x {op['name']}")


if __name__ == "__main__":
    main()
