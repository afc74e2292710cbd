"""The Python API: build a run from a TrainConfig, train, save, resume.

    trainer = Trainer(load_config("run.yaml"))
    trainer.fit()                       # or trainer.train_step([Batch(...), ...])
    trainer.evaluate()                  # loss and perplexity of the held-out data
    trainer.save_pretrained("out/hf")   # loads with AutoModelForCausalLM.from_pretrained
    trainer.close()

`fit` writes output_dir/metrics.jsonl (runlog.py), evaluates every eval_every steps, and saves the
state and the model (with its tokenizer) at the end; `plan_report` is `megatrain plan`.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import torch

from megatrain import checkpoint, memory
from megatrain.batch import Batch
from megatrain.config import TrainConfig
from megatrain.data import load_tokenizer, make_sources
from megatrain.device import Device
from megatrain.engine import Engine
from megatrain.io import write_json
from megatrain.metrics import PeakSampler, device_peak_allocated, model_flops
from megatrain.optim import lr_at
from megatrain.resolve import Machine, resolve
from megatrain.runlog import RunLog, perplexity
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.store import HostStore, pretrained_shards
from megatrain.templates import Architecture
from megatrain.units import GiB


# Settings whose change alters what a resumed run means: the schedule's length and shape, the
# optimizer, the data and its order, the batch. Engine settings change how, not what.
MEANING = ("steps", "epochs", "seed", "optim", "data")


def meaning_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """`key: saved -> now` for each setting of MEANING that differs from the saved run's config."""
    now = dataclasses.asdict(cfg)
    out = []
    for key in MEANING:
        a, b = saved.get(key), now[key]
        pairs = [(f"{key}.{k}", a.get(k), v) for k, v in b.items()] if isinstance(b, dict) and isinstance(a, dict) \
            else [(key, a, b)]
        out += [f"{name}: {x!r} -> {y!r}" for name, x, y in pairs if _normal(x) != _normal(y)]
    return out


def _normal(value):
    return list(value) if isinstance(value, tuple) else value


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        hf = load_hf_config(cfg.model)
        self.shape = shape = ModelShape(hf)
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and cfg.data.seq_len > limit:
            raise ValueError(f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings {limit}")
        self._check_output_dir()
        if cfg.model.pretrained:
            pretrained_shards(Path(cfg.model.pretrained))
        self.device = Device(cfg.engine.device)
        machine = Machine.of(self.device, cfg.engine)
        self.settings = s = resolve(cfg.engine, cfg.data, cfg.optim, shape, machine)
        # the model is admitted before the data is read, the data before the store is allocated:
        # a run that cannot fit, or a bad dataset, costs nothing
        memory.admit(memory.plan(shape, s), machine.host_available, machine.device_free)
        self.data, self.held_out = make_sources(cfg.data, shape.vocab, cfg.model.pretrained)
        data_bytes = self.data.nbytes + (self.held_out.nbytes if self.held_out else 0)
        if data_bytes:  # the data's bytes may be what makes split masters needed (engine.split_masters: auto)
            self.settings = s = resolve(cfg.engine, cfg.data, cfg.optim, shape, machine, data_bytes)
        self.memory_plan = memory.plan(shape, s, data_bytes)
        memory.admit(self.memory_plan, machine.host_available, machine.device_free)
        self.total_steps = cfg.steps if cfg.steps is not None else self.data.steps_for(cfg.epochs)
        if s.optimizer_threads:
            torch.set_num_threads(s.optimizer_threads)
        self.arch = Architecture(shape, s.mlp_chunk_tokens)
        self.store = HostStore(shape, s, self.device.torch)
        if cfg.model.pretrained:
            self.store.load_pretrained(cfg.model.pretrained)
        else:
            self.store.init_random(cfg.seed)
        self.engine = Engine(self.arch, self.store, self.device, s, cfg.optim, self.total_steps)
        self.sampler = PeakSampler(gpu_index=self.device.torch.index if self.device.is_cuda else None)
        self.step = 0
        if cfg.resume:
            self.load_state(Path(cfg.output_dir) / "state")

    def _check_output_dir(self) -> None:
        """Before anything is built: output_dir can be written, and resume has a state to resume."""
        if not self.cfg.output_dir:
            return
        out = Path(self.cfg.output_dir)
        existing = next((p for p in (out, *out.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ValueError(f"output_dir {out}: {existing} is a file, not a folder")
        if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"output_dir {out}: {existing} cannot be written")
        if self.cfg.resume:
            saved = checkpoint.saved_state(out / "state")
            if saved is None:
                raise ValueError(f"resume=true: no saved training state in {out} (nothing to resume; "
                                 f"leave resume unset to start the run)")
            changes = meaning_changes(json.loads((saved / "state.json").read_text())["config"], self.cfg)
            if changes and not self.cfg.resume_changes:
                raise ValueError(f"resume=true: this run's settings differ from the saved run's in {'; '.join(changes)}; "
                                 f"set resume_changes=true to resume with them anyway")

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
            "lr": lr_at(self.step - 1, self.cfg.optim, self.total_steps),
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

    def fit(self, log=None, progress: bool = True) -> list[dict]:
        """Train to the run's steps: metrics to output_dir/metrics.jsonl (and TensorBoard), a
        progress bar and summary lines on stderr, raw JSON lines on `log` if given; evaluations of
        the held-out data every eval_every steps and at the end; the state and the model saved."""
        cfg = self.cfg
        out = Path(cfg.output_dir) if cfg.output_dir else None
        runlog = RunLog(cfg.output_dir, self.total_steps, self.step, cfg.log_every, progress, cfg.tensorboard, log)
        history: list[dict] = []
        pending: dict | None = None  # the last step's record, awaiting its gradient norm

        def emit(norm_known: bool = False) -> None:
            nonlocal pending
            if pending is not None:
                if not norm_known:  # read after waiting for the optimizer
                    self.engine.worker.flush()
                    pending["grad_norm"] = self.engine.worker.grad_norms.get(pending["step"] - 1)
                runlog.step({k: v for k, v in pending.items() if k != "prev_grad_norm"})
                pending = None

        try:
            runlog.say(self.describe() + (f"\nresuming at step {self.step}" if self.step else ""))
            while self.step < self.total_steps:
                m = self.train_step(self.next_microbatches())
                runlog.advance(m)
                if pending is not None:
                    pending["grad_norm"] = m["prev_grad_norm"]
                    emit(norm_known=True)
                pending = m
                history.append(m)
                last = self.step == self.total_steps
                if self.held_out and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                    emit()
                    runlog.evaluation(self.evaluate())
                if out and cfg.save_every and self.step % cfg.save_every == 0 and not last:
                    emit()
                    self.save_state(out / "state")
            emit()
            if out:
                self.save_state(out / "state")
                self.save_pretrained(out / "model")
                runlog.say(f"saved: the training state in {out / 'state'}, the model in {out / 'model'}")
        finally:
            runlog.close()
        for m in history:  # the records the log got, norms included
            m.setdefault("grad_norm", self.engine.worker.grad_norms.get(m["step"] - 1))
        return history

    def evaluate(self) -> dict:
        """Mean loss and perplexity over the held-out data (eval_batches micro-batches at most),
        grad_accum micro-batches at a time, through the engine's streaming forward."""
        if self.held_out is None:
            raise ValueError("evaluate needs held-out data: data.eval_path or data.eval_fraction")
        start = time.perf_counter()
        loss = targets = 0
        batches = list(itertools.islice(self.held_out.batches(), self.cfg.eval_batches))
        for lo in range(0, len(batches), self.cfg.data.grad_accum):
            part, n = self.engine.evaluate(batches[lo: lo + self.cfg.data.grad_accum])
            loss, targets = loss + part, targets + n
        mean = loss / max(1, targets)
        return {"step": self.step, "eval_loss": mean, "eval_perplexity": perplexity(mean),
                "eval_target_tokens": targets, "eval_time_s": time.perf_counter() - start}

    def describe(self) -> str:
        """The start-up summary: the model, the data, the memory plan and where things go."""
        return describe(self.cfg, self.shape, self.settings, self.memory_plan, self.total_steps, self.data, self.held_out)

    # ---- saving ----
    def save_pretrained(self, path: str | Path, dtype: str | None = None) -> None:
        """The model as a `transformers` folder: weights in `dtype` (default: save_dtype), the
        generation config, and the tokenizer where the run has one."""
        self.engine.worker.flush()  # every update of the last step is written
        tok_dir = self.cfg.data.tokenizer or self.cfg.model.pretrained
        tokenizer = None
        if tok_dir and any((Path(tok_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = load_tokenizer(tok_dir)
        checkpoint.save_pretrained(self.store, self.shape, path, getattr(torch, dtype or self.cfg.save_dtype), tokenizer)

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


def describe(cfg: TrainConfig, shape: ModelShape, s, plan: memory.MemoryPlan, total_steps: int, data,
             held_out) -> str:
    """The start-up summary (and `megatrain plan`'s report)."""
    d, c = cfg.data, shape.config
    model = cfg.model.pretrained or cfg.model.config or f"preset {cfg.model.preset}"
    lines = [f"model: {c.model_type} from {model}: {shape.total_params():,} parameters, "
             f"{shape.num_layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab}"]
    if d.source == "file":
        dropped = {k: v for k, v in data.examples.dropped.items() if v}
        lines.append(f"data: {d.path} ({d.format}): {len(data.examples):,} examples, "
                     f"{int(data.examples.lengths.sum()):,} tokens, {data.nbytes / GiB:.2f} GiB in host memory"
                     + (f"; left out: {dropped}" if dropped else "")
                     + (f"; held out: {len(held_out.examples):,} examples" if held_out else ""))
        rows = "packed rows" if d.packing else "examples padded to the longest of their batch"
        epochs = total_steps * d.batch_size * d.grad_accum / data.rows_per_epoch()
        lines.append(f"step: {d.grad_accum} x {d.batch_size} {rows} of at most {d.seq_len} tokens: up to "
                     f"{d.grad_accum * d.batch_size * d.seq_len:,} tokens per step; {total_steps} steps "
                     f"({epochs:.2f} epochs)")
    else:
        lines.append(f"data: synthetic; step: {d.grad_accum} x {d.batch_size} x {d.seq_len} = "
                     f"{d.grad_accum * d.batch_size * d.seq_len:,} tokens; {total_steps} steps")
    lines.append(f"engine: {s.device}, {s.compute_dtype} compute, {s.master_dtype} masters"
                 f"{' (split: shadow + low halves)' if s.split_masters else ''}, checkpoint every "
                 f"{s.checkpoint_every}, {s.device_tiles} device tiles, MLP chunk {s.mlp_chunk_tokens}, "
                 f"{s.no_recompute_layers} layers kept from recompute")
    host = {k: v for k, v in plan.detail.items() if not k.startswith("device.") and v}
    lines.append(f"memory plan: host {plan.host_bytes / GiB:.2f} GiB ("
                 + ", ".join(f"{k} {v / GiB:.2f}" for k, v in host.items())
                 + f"), device {plan.device_bytes / GiB:.2f} GiB")
    out = cfg.output_dir
    lines.append(f"outputs: {out}/metrics.jsonl, {out}/state, {out}/model" if out else "outputs: none (no output_dir)")
    return "\n".join(lines)


def plan_report(cfg: TrainConfig) -> str:
    """What a run would do and need, without allocating the model: `megatrain plan`."""
    shape = ModelShape(load_hf_config(cfg.model))
    device = Device(cfg.engine.device)
    machine = Machine.of(device, cfg.engine)
    data, held_out = make_sources(cfg.data, shape.vocab, cfg.model.pretrained)
    data_bytes = data.nbytes + (held_out.nbytes if held_out else 0)
    s = resolve(cfg.engine, cfg.data, cfg.optim, shape, machine, data_bytes)
    p = memory.plan(shape, s, data_bytes)
    try:
        memory.admit(p, machine.host_available, machine.device_free)
        verdict = "fits this machine"
    except memory.DoesNotFit as e:
        verdict = str(e)
    total = cfg.steps if cfg.steps is not None else data.steps_for(cfg.epochs)
    return describe(cfg, shape, s, p, total, data, held_out) + "\n" + verdict
