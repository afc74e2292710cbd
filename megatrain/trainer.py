"""The Python API: build a run from a TrainConfig, train, save, resume.

    trainer = Trainer(load_config("run.yaml"))
    trainer.fit()                       # or trainer.train_step([Batch(...), ...])
    trainer.save_pretrained("out/hf")   # loads with AutoModelForCausalLM.from_pretrained
    trainer.close()
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from megatrain import checkpoint, memory
from megatrain.batch import Batch
from megatrain.config import TrainConfig
from megatrain.data import make_source
from megatrain.device import Device
from megatrain.engine import Engine
from megatrain.io import write_json
from megatrain.metrics import PeakSampler, device_peak_allocated, model_flops
from megatrain.resolve import Machine, resolve
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.store import HostStore
from megatrain.templates import Architecture


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        hf = load_hf_config(cfg.model)
        self.shape = shape = ModelShape(hf)
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and cfg.data.seq_len > limit:
            raise ValueError(f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings {limit}")
        self.device = Device(cfg.engine.device)
        machine = Machine.of(self.device, cfg.engine)
        self.settings = s = resolve(cfg.engine, cfg.data, cfg.optim, shape, machine)
        self.memory_plan = memory.plan(shape, s)
        memory.admit(self.memory_plan, machine.host_available, machine.device_free)
        # the data source is validated before the store is allocated: a bad dataset costs nothing
        self.data = make_source(cfg.data, shape.vocab, cfg.model.pretrained)
        if s.optimizer_threads:
            torch.set_num_threads(s.optimizer_threads)
        self.arch = Architecture(shape, s.mlp_chunk_tokens)
        self.store = HostStore(shape, s, self.device.torch)
        if cfg.model.pretrained:
            self.store.load_pretrained(cfg.model.pretrained)
        else:
            self.store.init_random(cfg.seed)
        self.engine = Engine(self.arch, self.store, self.device, s, cfg.optim, cfg.steps)
        self.sampler = PeakSampler(gpu_index=self.device.torch.index if self.device.is_cuda else None)
        self.step = 0
        if cfg.resume and (Path(cfg.output_dir) / "state").exists():
            self.load_state(Path(cfg.output_dir) / "state")

    # ---- training ----
    def train_step(self, microbatches: list[Batch]) -> dict:
        """One optimizer step over the given micro-batches; returns the step's metrics."""
        if self.device.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device.torch)
        self.sampler.reset()
        r = self.engine.step(microbatches)
        self.step += 1
        a = self.shape
        flops = model_flops(a.matmul_params(), a.num_layers, a.hidden, r.seq_lengths)
        hw = self.engine.schedule(len(microbatches)).hardware_flops(a, self.settings.mlp_chunk_tokens, r.seq_lengths)
        self.sampler.sample()
        return {
            "step": self.step,
            "loss": r.loss,
            "prev_grad_norm": r.prev_grad_norm,
            "tokens": sum(r.seq_lengths),
            "target_tokens": r.target_tokens,
            "step_time_s": r.step_time_s,
            "tokens_per_s": sum(r.seq_lengths) / r.step_time_s,
            "model_tflops": flops / r.step_time_s / 1e12,
            "hardware_tflops": hw / r.step_time_s / 1e12,
            "peak_device_allocated_bytes": device_peak_allocated(self.device.torch),
            "peak_device_nvml_bytes": self.sampler.peak_nvml_bytes or None,
            "peak_host_bytes": self.sampler.peak_host_bytes,
            "bytes_h2d": r.bytes_h2d,
            "bytes_d2h": r.bytes_d2h,
            "optimizer_busy_s": self.engine.worker.busy_s,
            "wait_update_s": r.wait_update_s,
            "wait_slab_s": r.wait_slab_s,
            **({"exposed": self.engine.timeline.summary()} if self.settings.timeline else {}),
        }

    def write_trace(self, path: str | Path) -> None:
        """The last step's timeline as a Chrome trace (open it in https://ui.perfetto.dev)."""
        if not self.settings.timeline:
            raise ValueError("write_trace needs engine.timeline: true")
        write_json(path, self.engine.timeline.chrome_trace())

    def next_microbatches(self) -> list[Batch]:
        return [self.data.next() for _ in range(self.cfg.data.grad_accum)]

    def fit(self, log=sys.stdout, progress: bool = True) -> list[dict]:
        """Train to cfg.steps: a progress bar on stderr, one JSON line of metrics per step on `log`."""
        from tqdm import tqdm
        out = Path(self.cfg.output_dir) if self.cfg.output_dir else None
        history = []
        bar = tqdm(total=self.cfg.steps, initial=self.step, disable=not progress, unit="step", file=sys.stderr)
        while self.step < self.cfg.steps:
            m = self.train_step(self.next_microbatches())
            history.append(m)
            print(json.dumps(m), file=log, flush=True)
            bar.set_postfix(loss=f"{m['loss']:.4f}", tflops=f"{m['model_tflops']:.1f}")
            bar.update(1)
            if out and self.cfg.save_every and self.step % self.cfg.save_every == 0:
                self.save_state(out / "state")
        bar.close()
        if out:
            self.save_state(out / "state")
            self.save_pretrained(out / "model")
        return history

    # ---- saving ----
    def save_pretrained(self, path: str | Path) -> None:
        self.engine.worker.flush()  # every update of the last step is written
        checkpoint.save_pretrained(self.store, self.shape, path)

    def save_state(self, path: str | Path) -> None:
        self.engine.worker.flush()
        meta = {"step": self.step, "updates_done": self.engine.worker.updates_done,
                "data_position": self.data.position, "config": dataclasses.asdict(self.cfg),
                "settings": dataclasses.asdict(self.settings)}
        checkpoint.save_state(self.store, path, meta)

    def load_state(self, path: str | Path) -> None:
        self.engine.worker.flush()
        meta = checkpoint.load_state(self.store, path)
        self.step = meta["step"]
        self.engine.worker.updates_done = self.engine.worker.steps_begun = meta["updates_done"]
        self.data.position = meta["data_position"]

    def layer_ceiling(self, reps: int = 5) -> dict:
        """The engine's single-layer compute ceiling on one of this run's micro-batches (engine.py)."""
        return self.engine.layer_ceiling(self.cfg.data.batch_size, self.cfg.data.seq_len, reps)

    def close(self) -> None:
        self.engine.close()
        self.sampler.close()
