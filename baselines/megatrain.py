"""MegaTrain: this repository's engine, through its public Trainer API. To the harness it is one
system among its peers: the same spec, data, clock and FLOPs formula as every baseline.

Options: `engine` (EngineConfig fields, e.g. {"checkpoint_every": 1}), `max_grad_norm` (default:
no clipping, like every baseline here), `ceiling` (after the steps, the engine's single-layer compute
ceiling on the same micro-batch: Engine.layer_ceiling) and `trace` (write the last step's timeline as a Perfetto trace there).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megatrain.io import check_writable
from suite.system import System, check_options

class MegaTrain(System):
    OPTIONS = frozenset({"engine", "max_grad_norm", "ceiling", "trace"})

    def __init__(self, spec, device: torch.device):
        check_options("megatrain", spec.options, self.OPTIONS)
        self.options = spec.options
        cfg = spec.megatrain_config(str(device))
        if trace := spec.options.get("trace"):  # refused now, not once the steps have run
            if not cfg.engine.timeline:
                raise ValueError("megatrain options: trace writes the engine's timeline; it needs engine.timeline: true")
            check_writable(Path(trace).parent, "megatrain options: trace")
        from megatrain.trainer import Trainer
        self.trainer = Trainer(cfg, progress=False)  # DoesNotFit says which memory ran short; the harness logs its own lines

    def step(self, microbatches) -> dict:
        row = self.trainer.train_step(microbatches)
        # the harness's wall clock times every system: the engine's own time is kept apart, and the
        # FLOPs it executed go back as a count, for the harness to divide by that same clock
        engine_s = row.pop("step_time_s")
        hardware_flops = row.pop("hardware_tflops") * 1e12 * engine_s
        return {**row, "engine_step_time_s": engine_s, "hardware_flops": hardware_flops}

    def save(self, path: str) -> None:
        self.trainer.save_pretrained(path)

    def info(self) -> dict:
        t = self.trainer
        out = {"memory_plan": t.memory_plan.detail, "engine": dataclasses.asdict(t.settings),
               "master_dtype": t.settings.master_dtype, "compute_dtype": str(t.settings.compute),
               "setup_s": t.setup_s, "optimizer_kernel_note": t.optimizer_kernel_note,
               "pinned_shadows": "exact",  # registered at their size: store.Blocks
               "whole_masters": "streamed",  # cast on the device, no bf16 shadow on the host (store.py)
               "unread_experts": True}  # the recompute leaves out what nothing reads of the experts (lean_experts.py)
        if self.options.get("trace"):
            t.write_trace(self.options["trace"])
        if self.options.get("ceiling") and t.device.is_cuda:
            out["ceiling"] = t.layer_ceiling()
        return out

    def close(self) -> None:
        self.trainer.close()
