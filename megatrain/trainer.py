"""The Python API: build a run from a TrainConfig, train, save, resume.

    trainer = Trainer(load_config("run.yaml"))
    trainer.fit()                       # or trainer.train_step([Batch(...), ...])
    trainer.evaluate()                  # loss, perplexity and token accuracy of the held-out data
    trainer.save_pretrained("out/hf")   # loads with AutoModelForCausalLM.from_pretrained
    trainer.close()

`fit` writes output_dir/metrics.jsonl (runlog.py), evaluates every eval_every steps, saves the state
and the model as checkpoint-N every save_every steps (exports.py), keeps the best model by
evaluation, stops early, and saves the state and the model (with its tokenizer) at the end or
after the step a Ctrl-C came in. What a run is (its shape, settings, memory plan,
data) is decided by planning.plan_run, which `megatrain plan` prints.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import shutil
import signal
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from megatrain import checkpoint, fused_adamw
from megatrain.batch import Batch
from megatrain.config import TrainConfig
from megatrain.data import load_tokenizer
from megatrain.distributed import Comm, Flags, Ranks, SharedArena, shard_batch
from megatrain.engine import Engine
from megatrain.exports import Best, checkpoint_dir, rotate
from megatrain.io import drop_previous, remove_dir, remove_stale, roll_back, write_json
from megatrain.kernels import EXPERTS, MLP, NORM, OPTIMIZER, ROTARY, SINKS
from megatrain.metrics import PeakSampler, device_peak_allocated, model_flops
from megatrain.planning import RunPlan, earlier_outputs, plan_run
from megatrain.progress import bar, say
from megatrain.runlog import RunLog, perplexity
from megatrain.store import HostStore
from megatrain.templates import Architecture
from megatrain.units import GiB


# the divergence guard's window: the median of the last steps' losses a step's loss is judged by
DIVERGENCE_WINDOW = 20
DIVERGENCE_NATS = 1.0  # and by at least this much over it: near zero loss a blip is a multiple


class Diverged(FloatingPointError):
    """A step's loss far above the recent ones' (divergence_factor): the run diverged without a NaN."""


def divergence(loss: float, recent: list[float], factor: float | None) -> str | None:
    """Why `loss` is a divergence from the `recent` losses (the guard, divergence_factor), or None."""
    if factor is None or not recent:
        return None
    median = statistics.median(recent[-DIVERGENCE_WINDOW:])
    if math.isfinite(loss) and not (loss > factor * median and loss > median + DIVERGENCE_NATS):
        return None
    return (f"the loss {loss:.6g} is over divergence_factor {factor:g} times the median {median:.4g} of the last "
            f"{min(len(recent), DIVERGENCE_WINDOW)} steps' losses: the run diverged")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, taken at the end of the step it came in: `model` holds that step's weights."""

    def __init__(self, step: int, model: Path):
        super().__init__(step, model)
        self.step, self.model = step, model


@contextmanager
def deferred_interrupt(enabled: bool, say):
    """Within: a first Ctrl-C (SIGINT) is only noted, so that the step it came in completes (a
    step cut short leaves some tiles updated and others not: no model of any step to export); the
    returned function says whether it came. A second stops at once, as Ctrl-C does outside. Off
    where the process's main thread is not the caller (signals reach that thread only)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    came: list[bool] = []
    before = signal.getsignal(signal.SIGINT)

    def note(signum, frame):
        came.append(True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        say("interrupted: the step under way completes and its model is saved; Ctrl-C again stops at once")
    signal.signal(signal.SIGINT, note)
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(signal.SIGINT, before)


class Trainer:
    def __init__(self, run: TrainConfig | RunPlan, progress: bool = True):
        """`run`: the run's config, planned here for this process's rank (planning.plan_run), or its
        plan; a plan that does not fit is refused (DoesNotFit) before anything is allocated. Under
        torchrun, one of the run's data-parallel ranks (distributed.py): each rank takes its rows of
        every micro-batch, the ranks of a host share one host store, one rank writes. `progress`:
        bars on stderr for the long work outside the steps (filling the store, saving and loading),
        from the first rank."""
        plan = run if isinstance(run, RunPlan) else plan_run(run, Ranks.from_env())
        if plan.device is None:
            raise ValueError(f"engine.device is {plan.cfg.engine.device!r} but this machine has no GPU: a plan for "
                             f"the stated machine trains there")
        plan.check()
        self.plan = plan
        self.cfg = cfg = plan.cfg
        self.ranks = ranks = plan.ranks
        self.progress = progress and ranks.rank == 0
        self.shape = shape = plan.shape
        self.device, self.settings, self.memory_plan = plan.device, plan.settings, plan.memory_plan
        self.data, self.held_out, self.total_steps = plan.data, plan.held_out, plan.total_steps
        s = self.settings
        self.comm = Comm.init(ranks, self.device.torch)
        self._threads_before = torch.get_num_threads()  # the process's again at close
        if s.optimizer_threads:
            torch.set_num_threads(s.optimizer_threads)
        elif ranks.local_world > 1:  # the host's cores shared by its ranks' optimizers
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks.local_world))
        # seconds spent having the host AdamW's kernel (the planner loaded it from the per-user cache
        # or built it there: fused_adamw.build, once a process), allocating the store, filling it and
        # building the engine (its buffers)
        self.setup_s = {"optimizer_kernel": 0.0}
        self.optimizer_kernel_note = plan.optimizer_note
        if self.optimizer_kernel_note:
            say(self.optimizer_kernel_note, ranks.rank == 0)
        if OPTIMIZER.runs(s):
            built = fused_adamw.build()
            self.optimizer_kernel_note = f"{'built' if built.compiled else 'loaded'} {built.path}"
            self.setup_s["optimizer_kernel"] = built.seconds
        self.arch = Architecture(shape, s.mlp_chunk_tokens, NORM.runs(s), MLP.runs(s), lean_moe=EXPERTS.runs(s),
                                 keep_attention=s.keep_attention_layers > 0, compiled_rotary=ROTARY.runs(s),
                                 compiled_sinks=SINKS.runs(s))
        say(f"allocating the host store ({HostStore.nbytes(shape, s)[0] / GiB:.1f} GiB)", self.progress)
        clock = time.perf_counter()
        self.arena = flags = None
        if ranks.distributed:  # one store per host, in shared memory, filled by the host's first rank
            names = [name for name, _ in shape.units()]
            store_bytes = HostStore.nbytes(shape, s)[0]
            self.arena = SharedArena(store_bytes + Flags.nbytes(len(names), ranks.local_world),
                                     self.comm.run_name(), self.comm)
            self.store = HostStore(shape, s, self.device.torch, self.arena.take)
            flags = Flags(self.arena.take(Flags.nbytes(len(names), ranks.local_world)), names, ranks.local_rank)
        else:
            self.store = HostStore(shape, s, self.device.torch)
        self.setup_s["store"] = time.perf_counter() - clock
        clock = time.perf_counter()
        self._fill_store()
        self.setup_s["fill"] = time.perf_counter() - clock
        clock = time.perf_counter()
        self.engine = Engine(self.arch, self.store, self.device, s, cfg.optim, self.total_steps, self.comm, flags)
        self.optimizer = self.engine.optimizer
        self.setup_s["engine"] = time.perf_counter() - clock
        self.sampler = PeakSampler(gpu_index=self.device.torch.index if self.device.is_cuda else None)
        self.step = 0
        self.best = (Best(cfg.metric_for_best_model, cfg.early_stopping_patience, cfg.early_stopping_threshold)
                     if cfg.metric_for_best_model else None)
        if cfg.resume:
            self.load_state(Path(cfg.output_dir) / "state")

    def _fill_store(self) -> None:
        """Seeded or pretrained weights; a shared store is filled once per host (device tiles, one
        copy per GPU, by every rank), then every rank waits for it."""
        cfg, first = self.cfg, self.ranks.local_rank == 0
        tiles = None if first else [t for t in self.store.tiles if t.on_device]
        if cfg.model.pretrained:
            with bar("loading the weights", self._params(tiles), self.progress) as advance:
                self.store.load_pretrained(cfg.model.pretrained, tiles, advance)
        else:
            with bar("initialising the weights", self._params(tiles), self.progress) as advance:
                self.store.init_random(cfg.seed, tiles, advance)
        self.comm.barrier()

    # ---- training ----
    def train_step(self, microbatches: list[Batch]) -> dict:
        """One optimizer step over the given (global) micro-batches; returns the step's metrics.
        With data-parallel ranks, each rank computes on its rows of every micro-batch (every rank
        is given the same micro-batches) and the metrics are the whole step's."""
        if self.device.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device.torch)
        self.sampler.reset()
        r = self.engine.step([self._rows(mb) for mb in microbatches])
        self.step += 1
        a = self.shape
        lengths = [n for mb in microbatches for n in mb.sequence_lengths()]  # every rank's rows
        flops = model_flops(a.matmul_params(), a.attention(), lengths)
        kept = [n for mb, k in zip(microbatches, r.attention_kept) if k for n in mb.sequence_lengths()]
        hw = self.engine.schedule(len(microbatches)).hardware_flops(a, self.settings.mlp_chunk_tokens, lengths, kept,
                                                                    EXPERTS.runs(self.settings) and MLP.runs(self.settings))
        self.sampler.sample()
        return {
            "step": self.step,
            "loss": r.loss,
            "lr": self.optimizer.lr(self.step - 1),
            "prev_grad_norm": r.prev_grad_norm,
            "tokens": sum(lengths),
            "target_tokens": r.target_tokens,
            "step_time_s": r.step_time_s,
            "tokens_per_s": sum(lengths) / r.step_time_s,
            "model_tflops": flops / r.step_time_s / 1e12,
            "hardware_tflops": hw / r.step_time_s / 1e12,
            "peak_device_allocated_bytes": device_peak_allocated(self.device.torch),
            "peak_device_nvml_bytes": self.sampler.peak_nvml_bytes or None,
            "peak_host_bytes": self.sampler.peak_host_bytes,
            "bytes_h2d": r.bytes_h2d,
            "bytes_d2h": r.bytes_d2h,
            "wait_update_s": r.wait_update_s,
            "wait_slab_s": r.wait_slab_s,
            **({"exposed": self.engine.timeline.summary()} if self.settings.timeline else {}),
        }

    def _rows(self, mb: Batch) -> Batch:
        """This rank's rows of a global micro-batch (rank-strided: distributed.shard_batch)."""
        return shard_batch(mb, self.ranks)

    def write_trace(self, path: str | Path) -> None:
        """The last step's timeline as a Chrome trace (open it in https://ui.perfetto.dev), once its
        optimizer updates, which run on after the step returns, are done and in it."""
        if not self.settings.timeline:
            raise ValueError("write_trace needs engine.timeline: true")
        self.optimizer.flush()
        write_json(path, self.engine.timeline.chrome_trace())

    def next_microbatches(self) -> list[Batch]:
        return [self.data.next() for _ in range(self.cfg.data.grad_accum)]

    def fit(self, log=None, progress: bool = True) -> list[dict]:
        """Train to the run's steps: metrics to output_dir/metrics.jsonl (and TensorBoard), a
        progress bar and summary lines on stderr, raw JSON lines on `log` if given; evaluations of
        the held-out data every eval_every steps and at the end; the state and the model saved."""
        cfg = self.cfg
        out = Path(cfg.output_dir) if cfg.output_dir else None
        if out and self.ranks.local_rank == 0:  # what saves cut short by a kill left (io.remove_stale)
            remove_stale(out)
            if cfg.resume and self.ranks.rank == 0:  # a save kept for a roll-back that never came
                drop_previous(out / "state")
        if out and cfg.overwrite and self.ranks.rank == 0:  # the earlier run's outputs go before any of this one's
            for path in earlier_outputs(out):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if self.ranks.rank != 0:  # one rank writes the log; every rank saves (the first alone writes)
            runlog = RunLog(None, self.total_steps, self.step, cfg.log_every, False, (), None, quiet=True)
        else:
            runlog = RunLog(cfg.output_dir, self.total_steps, self.step, cfg.log_every, progress, cfg.report_to, log,
                            config=dataclasses.asdict(cfg))
        history: list[dict] = []
        pending: dict | None = None  # the last step's record, awaiting its gradient norm
        losses: list[float] = []  # this run's, for the divergence guard
        # the step of the last save (its state and checkpoint), until the next step's loss judges its
        # weights: a divergence (or a non-finite step) rolls the state back and removes the checkpoint
        unjudged: int | None = None

        def emit(norm_known: bool = False) -> None:
            nonlocal pending
            if pending is not None:
                if not norm_known:  # read after waiting for the optimizer
                    self.optimizer.flush()
                    pending["grad_norm"] = self.optimizer.grad_norms.get(pending["step"] - 1)
                pending["optimizer_busy_s"] = self.optimizer.busy.get(pending["step"] - 1)
                runlog.step({k: v for k, v in pending.items() if k != "prev_grad_norm"})
                pending = None

        # one rank: the ranks would have to agree on the step to stop after, so Ctrl-C stops them at once
        with deferred_interrupt(out is not None and self.ranks.world == 1, runlog.say) as interrupted:
            try:
                runlog.say(self.describe() + (f"\nresuming at step {self.step}" if self.step else ""))
                while self.step < self.total_steps:
                    try:
                        m = self.train_step(self.next_microbatches())
                    except FloatingPointError:
                        if unjudged is not None:
                            self._roll_back(out, unjudged)
                        raise
                    runlog.advance(m)
                    if pending is not None:
                        pending["grad_norm"] = m["prev_grad_norm"]
                        emit(norm_known=True)
                    pending = m
                    history.append(m)
                    if why := divergence(m["loss"], losses, cfg.divergence_factor):
                        emit()
                        if unjudged is not None:
                            self._roll_back(out, unjudged)
                        raise Diverged(f"step {self.step}: {why} (lower optim.lr, keep optim.max_grad_norm set, or "
                                       f"set divergence_factor: null to train on); nothing of it was saved")
                    losses.append(m["loss"])
                    if unjudged is not None:
                        if self.ranks.rank == 0:
                            drop_previous(out / "state")
                        unjudged = None
                    last = self.step == self.total_steps
                    evaluation = None
                    if self.held_out and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                        emit()
                        evaluation = self.evaluate()
                        runlog.evaluation(evaluation)
                        if self.best is not None and self.best.judge(evaluation):
                            self.export(out / "best", evaluation)
                            runlog.say(f"step {self.step}: the best eval {self.best.metric} so far, "
                                       f"{self.best.value:.6g}: the model in {out / 'best'}")
                    if out and cfg.save_every and self.step % cfg.save_every == 0 and not last:
                        emit()
                        self.save_state(out / "state", keep_previous=True)
                        self.export(checkpoint_dir(out, self.step), evaluation)
                        if self.ranks.rank == 0:
                            rotate(out, cfg.save_total_limit, self.best.step if self.best else None)
                        unjudged = self.step
                    if self.best is not None and self.best.stop:
                        runlog.say(f"early stop at step {self.step}: {self.best.stale} evaluations without improving "
                                   f"eval {self.best.metric} by more than {self.best.threshold:g} (its best "
                                   f"{self.best.value:.6g}, step {self.best.step}; early_stopping_patience)")
                        break
                    if interrupted():
                        emit()
                        self.export(out / "model", evaluation)
                        raise Interrupted(self.step, out / "model")
                emit()
                if out:
                    self.save_state(out / "state")
                    self.export(out / "model")
                    runlog.say(f"saved: the training state in {out / 'state'}, the model in {out / 'model'}")
            finally:
                runlog.close()
        for m in history:  # the records the log got, norms included
            m.setdefault("grad_norm", self.optimizer.grad_norms.get(m["step"] - 1))
            m.setdefault("optimizer_busy_s", self.optimizer.busy.get(m["step"] - 1))
        return history

    def evaluate(self) -> dict:
        """Mean loss, perplexity and token accuracy (the share of target tokens that are the logits'
        argmax) over the held-out data (eval_batches micro-batches at most),
        grad_accum micro-batches at a time, through the engine's streaming forward."""
        if self.held_out is None:
            raise ValueError("evaluate needs held-out data: data.eval_path, data.eval_fraction or data.eval_split")
        start = time.perf_counter()
        loss = targets = correct = 0
        batches = list(itertools.islice(self.held_out.batches(), self.cfg.eval_batches))
        for lo in range(0, len(batches), self.cfg.data.grad_accum):
            # the last batch may have fewer rows than there are ranks: a rank may get none
            mine = [mb for mb in map(self._rows, batches[lo: lo + self.cfg.data.grad_accum]) if mb.input_ids.shape[0]]
            if mine:
                part, n, hits = self.engine.evaluate(mine)
                loss, targets, correct = loss + part, targets + n, correct + hits
        loss, targets, correct = self.comm.sum_values(loss, targets, correct)  # summed over ranks as floats
        mean = loss / max(1, targets)
        return {"step": self.step, "eval_loss": mean, "eval_perplexity": perplexity(mean),
                "eval_accuracy": correct / max(1, targets), "eval_target_tokens": int(targets),
                "eval_time_s": time.perf_counter() - start}

    def describe(self) -> str:
        """The start-up summary: the model, the data, the memory plan and where things go."""
        return self.plan.describe()

    # ---- saving ----
    def export(self, path: Path, evaluation: dict | None = None) -> None:
        """The model of this step as a run saves it (save_pretrained), with the step and the
        evaluation of its weights, if one was made, beside it (exports.META)."""
        self.save_pretrained(path, meta={"step": self.step, "eval": evaluation})

    def save_pretrained(self, path: str | Path, dtype: str | None = None, meta: dict | None = None) -> None:
        """The model as a `transformers` folder: weights in `dtype` (default: save_dtype), the
        generation config, and the tokenizer where the run has one; `meta` beside them, if given."""
        if not self._all_updated():
            return
        tok_dir = self.cfg.data.tokenizer or self.cfg.model.pretrained
        tokenizer = None
        if tok_dir and any((Path(tok_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = load_tokenizer(tok_dir, self.cfg.data.chat_template)
        with bar(f"saving the model to {path}", self._params(), self.progress) as advance:
            checkpoint.save_pretrained(self.store, self.shape, path, getattr(torch, dtype or self.cfg.save_dtype),
                                       tokenizer, advance, meta)

    def _params(self, tiles=None) -> int:
        """The parameters of `tiles` (None: every tile), without padding: what a bar counts."""
        return sum(t.layout.params for t in tiles or self.store.tiles)

    def _all_updated(self) -> bool:
        """Wait until every rank's updates are written; True on the rank that writes (the store is
        whole on every host, so it gathers nothing)."""
        self.optimizer.flush()
        self.comm.barrier()
        return self.ranks.rank == 0

    def _roll_back(self, out: Path, step: int) -> None:
        """The weights saved at `step` gave a diverged or non-finite loss: the state back to the one
        that save replaced (none where it was the first), its checkpoint removed, on the rank that writes."""
        if self.ranks.rank == 0:
            roll_back(out / "state")
            if (saved := checkpoint_dir(out, step)).exists():
                remove_dir(saved)

    def save_state(self, path: str | Path, keep_previous: bool = False) -> None:
        """`keep_previous`: the state replaced is kept until the caller drops or rolls back to it."""
        if not self._all_updated():
            return
        meta = {"step": self.step, "updates_done": self.optimizer.steps,
                "data_position": self.data.position, "config": dataclasses.asdict(self.cfg),
                "settings": dataclasses.asdict(self.settings), "best": self.best.state() if self.best else None}
        with bar(f"saving the training state to {path}", self._params(), self.progress) as advance:
            checkpoint.save_state(self.store, path, meta, advance, keep_previous)

    def load_state(self, path: str | Path) -> None:
        """Every rank reads the step and data position; a shared store is read once per host
        (device tiles by every rank), then every rank waits for it."""
        self.optimizer.flush()
        self.comm.barrier()
        tiles = None if self.ranks.local_rank == 0 else [t for t in self.store.tiles if t.on_device]
        with bar("loading the training state", self._params(), self.progress and tiles is None) as advance:
            meta = checkpoint.load_state(self.store, path, tiles, advance)
        self.comm.barrier()
        self.step = meta["step"]
        self.optimizer.steps = meta["updates_done"]
        self.data.position = meta["data_position"]
        if self.best is not None:  # a state saved without a best model (an earlier run's) starts afresh
            self.best.restore(meta.get("best"))

    def layer_ceiling(self, reps: int = 5) -> dict:
        """The engine's single-layer compute ceiling on one of this run's micro-batches (engine.py),
        taken on the first layer of each attention kind (GPT-OSS's sliding-window and full layers
        differ): each layer's seconds by its kind's (`seconds_by_layer`), their mean (`seconds`) and
        the model TFLOP/s of all layers at those seconds."""
        shape, batch, seq = self.engine.shape, self.cfg.data.batch_size, self.cfg.data.seq_len
        kinds = [shape.layer_type(i) for i in range(shape.num_layers)]
        by_kind = {k: self.engine.layer_ceiling(batch, seq, reps, index=kinds.index(k)) for k in dict.fromkeys(kinds)}
        seconds = [by_kind[k]["seconds"] for k in kinds]
        flops = sum(by_kind[k]["model_tflops"] * by_kind[k]["seconds"] for k in kinds)
        return {"seconds": sum(seconds) / len(seconds), "model_tflops": flops / sum(seconds),
                "tokens": batch * seq, "seconds_by_layer": {f"L{i}": s for i, s in enumerate(seconds)},
                "by_layer_type": by_kind}

    def close(self) -> None:
        self.engine.close()
        self.sampler.close()
        self.store.close()
        self.comm.close()
        torch.set_num_threads(self._threads_before)
