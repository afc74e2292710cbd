"""MegaTrain: this repository's engine, through its public Trainer API.

Options: `engine` (EngineConfig fields, e.g. {"checkpoint_every": 1}), `max_grad_norm` (default:
no clipping, like every baseline here), `ceiling` (after the steps, time one decoder layer's
forward + recompute + backward with its weights resident, on the same micro-batch: the compute
ceiling of layer streaming) and `trace` (write the last step's timeline as a Perfetto trace there).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from megatrain.config import load_config
from megatrain.metrics import model_flops
from megatrain.unread_mlp import output_unused
from suite.systems import DoesNotFit

_OPTIONS = {"engine", "max_grad_norm", "ceiling", "trace"}


class System:
    def __init__(self, spec, device: torch.device):
        unknown = sorted(set(spec.options) - _OPTIONS)
        if unknown:
            raise ValueError(f"megatrain options: unknown {unknown}; known: {sorted(_OPTIONS)}")
        self.options = spec.options
        tree = {
            "model": spec.model,
            "engine": {"device": str(device), **spec.options.get("engine", {})},
            "optim": {"lr": spec.lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                      "betas": [0.9, 0.95], "eps": 1e-8, "max_grad_norm": spec.options.get("max_grad_norm")},
            "data": {"source": "synthetic", "seq_len": spec.seq_len, "batch_size": spec.batch_size,
                     "grad_accum": spec.grad_accum, "seed": spec.seed, "repeat_batch": spec.repeat_batch},
            "steps": spec.total_steps,
            "seed": spec.seed,
        }
        cfg = load_config(None, [], base=tree)
        from megatrain.trainer import Trainer
        try:
            self.trainer = Trainer(cfg)
        except ValueError as e:
            text = str(e)
            if "host memory" in text:
                raise DoesNotFit("oom_host", text) from None
            if "device memory" in text:
                raise DoesNotFit("oom_device", text) from None
            raise

    def step(self, microbatches) -> dict:
        return self.trainer.train_step(microbatches)

    def save(self, path: str) -> None:
        self.trainer.save_pretrained(path)

    def info(self) -> dict:
        t = self.trainer
        out = {"memory_plan": t.memory_plan.detail, "engine": vars(t.cfg.engine),
               "master_dtype": t.cfg.engine.master_dtype, "compute_dtype": str(t.compute_dtype)}
        if self.options.get("trace"):
            t.write_trace(self.options["trace"])
        if self.options.get("ceiling") and t.device.is_cuda:
            out["ceiling"] = layer_ceiling(t)
        return out

    def close(self) -> None:
        self.trainer.close()


def layer_ceiling(trainer, reps: int = 5) -> dict:
    """One decoder layer, weights resident, on one micro-batch: forward, recompute, backward;
    with K = 1 every recompute is a block's last layer's, which leaves its unread MLP output out."""
    engine, arch, cfg = trainer.engine, trainer.arch, trainer.cfg.data
    root_only = trainer.cfg.engine.checkpoint_every == 1
    dev = engine.dev
    unit = engine.layer_units[0]
    flat = engine.streamer.flat[0]
    flat[: unit.numel].copy_(unit.tiles[0].source)
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
            with torch.enable_grad(), (output_unused() if root_only else contextlib.nullcontext()):
                out = engine._layer(0, leaves, x, ctx)
            torch.autograd.grad(out, [x, *leaves], dy)
            dev.synchronize()
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    flops = model_flops(arch.layer_matmul_params(), 1, arch.hidden, [cfg.seq_len] * cfg.batch_size)
    return {"seconds": seconds, "model_tflops": flops / seconds / 1e12, "tokens": cfg.seq_len * cfg.batch_size}
