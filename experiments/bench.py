"""One benchmark point of the MegaTrain engine, in this process; one JSON result.

    python3 experiments/bench.py --preset qwen2.5-7b --seq 4096 --batch 4 --accum 4 \
        --out results/h100/speed/qwen2.5-7b.json --ceiling --trace trace.json engine.checkpoint_every=1

Random weights, synthetic tokens, constant learning rate. Steps after `--warmup` are the samples;
the result holds the point's spec, the environment, every step's metrics, their medians, the
memory peaks, the exposed-time breakdown (GPU busy fraction, compute waiting on weights, the
optimizer's exposed time) and, with --ceiling, the single-layer ceiling measured afterwards in the
same process on the same micro-batch: one decoder layer's forward + recompute + backward with its
weights resident, by the same FLOPs formula. A run the memory admission refuses is a result
(status oom_host / oom_device with the reason), not a crash. The file is written atomically.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from megatrain.checkpoint import write_json
from megatrain.config import load_config
from megatrain.metrics import environment, model_flops


def spec_from_args(args) -> dict:
    overrides = {}
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    return {
        "model": {"preset": args.preset, "overrides": overrides},
        "optim": {"lr": 1e-5, "schedule": "constant", "warmup_steps": 0,
                  "max_grad_norm": args.clip, "weight_decay": 0.0},
        "data": {"source": "synthetic", "seq_len": args.seq, "batch_size": args.batch,
                 "grad_accum": args.accum, "seed": 0},
        "steps": args.warmup + args.steps,
    }


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def layer_ceiling(trainer, reps: int = 5) -> dict:
    """One decoder layer, weights resident, on one micro-batch: forward, recompute, backward."""
    engine, arch, cfg = trainer.engine, trainer.arch, trainer.cfg.data
    dev = engine.dev
    unit = engine.layer_units[0]
    flat = engine.streamer.flat[0]
    flat[: unit.numel].copy_(unit.tiles[0].shadow)
    weights = unit.views(flat)
    gen = torch.Generator(device=dev.torch).manual_seed(0)
    shape = (cfg.batch_size, cfg.seq_len, arch.hidden)
    x0 = torch.randn(shape, generator=gen, device=dev.torch, dtype=engine.dtype)
    dy = torch.randn(shape, generator=gen, device=dev.torch, dtype=engine.dtype)
    ctx = engine._context(x0, None)
    times = []
    with dev.on(dev.compute):
        for _ in range(reps + 1):
            dev.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                engine._layer(0, weights, x0, ctx)
            leaves = [w.detach().requires_grad_() for w in weights]
            x = x0.detach().requires_grad_()
            with torch.enable_grad():
                out = engine._layer(0, leaves, x, ctx)
            torch.autograd.grad(out, [x, *leaves], dy)
            dev.synchronize()
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    per_layer = (arch.matmul_params() - arch.vocab * arch.hidden) // arch.num_layers
    flops = model_flops(per_layer, 1, arch.hidden, [cfg.seq_len] * cfg.batch_size)
    return {"seconds": seconds, "model_tflops": flops / seconds / 1e12, "tokens": cfg.seq_len * cfg.batch_size}


def run(args) -> dict:
    spec = spec_from_args(args)
    result = {"system": "megatrain", "spec": spec, "overrides": args.overrides, "status": "error"}
    try:
        cfg = load_config(None, args.overrides, base=spec)
    except ValueError as e:
        return {**result, "status": "error", "reason": str(e)}
    from megatrain.trainer import Trainer
    try:
        trainer = Trainer(cfg)
    except ValueError as e:
        status = "oom_host" if "host memory" in str(e) else "oom_device" if "device memory" in str(e) else "error"
        return {**result, "status": status, "reason": str(e), "env": environment()}
    result["env"] = environment(trainer.device.torch)
    result["memory_plan"] = trainer.memory_plan.detail
    rows = []
    try:
        for step in range(cfg.steps):
            m = trainer.train_step(trainer.next_microbatches())
            rows.append(m)
            print(f"step {m['step']}: {m['step_time_s']:.2f} s, {m['model_tflops']:.1f} TFLOP/s, "
                  f"loss {m['loss']:.4f}", file=sys.stderr, flush=True)
        if args.trace:
            trainer.write_trace(args.trace)
        samples = rows[args.warmup:]
        result["steps"] = rows
        result["median"] = {k: median_of(samples, k) for k in (
            "step_time_s", "tokens_per_s", "model_tflops", "hardware_tflops", "optimizer_busy_s",
            "wait_update_s", "wait_slab_s")}
        if samples and "exposed" in samples[0]:
            result["median"]["exposed"] = {k: median_of([s["exposed"] for s in samples], k)
                                           for k in samples[0]["exposed"]}
        result["peak"] = {k: max((r[k] or 0) for r in rows) for k in (
            "peak_device_allocated_bytes", "peak_device_nvml_bytes", "peak_host_bytes")}
        result["params"] = trainer.arch.total_params()
        if args.ceiling and trainer.device.is_cuda:
            result["ceiling"] = layer_ceiling(trainer)
            result["ratio_to_ceiling"] = result["median"]["model_tflops"] / result["ceiling"]["model_tflops"]
        result["status"] = "ok"
    except torch.cuda.OutOfMemoryError as e:
        result.update(status="oom_device", reason=str(e).splitlines()[0], steps=rows)
    except Exception as e:  # a failed point is a result
        result.update(status="error", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                      steps=rows)
    finally:
        trainer.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="model shape (megatrain.presets)")
    p.add_argument("--layers", type=int, help="override the number of decoder layers")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=5, help="measured steps after the warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=None, help="max grad norm (default: no clipping)")
    p.add_argument("--ceiling", action="store_true", help="also measure the single-layer ceiling")
    p.add_argument("--trace", help="write the last step's timeline as a Chrome/Perfetto trace here")
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("overrides", nargs="*", help="run settings as key.sub=value (e.g. engine.checkpoint_every=2)")
    args = p.parse_args(argv)
    result = run(args)
    write_json(args.out, result)
    med = result.get("median", {})
    print(f"{Path(args.out).name}: {result['status']} {med.get('model_tflops') or 0:.1f} TFLOP/s "
          f"{result.get('reason', '')}", file=sys.stderr)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
