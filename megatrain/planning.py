"""One planner: a run's config to its plan, for `megatrain plan` and `megatrain train` alike.

`plan_run` makes every check and decision a run makes before it allocates anything, in the order
in which a refusal costs least: the model's shape (the sequence it allows, a checkpoint's tensors),
output_dir, the machine, the settings with every `auto` decided (resolve.py), the memory plan of
the model alone, the disk its saves need, then the data and the plan with its bytes. A bad
setting, file or output_dir (or one whose disk cannot hold the saves) raises ValueError. A run that
does not fit is still a plan: its `refusal` is the DoesNotFit that `train` raises (`RunPlan.check`)
and that `plan` prints after the report. The trainer builds from the plan and derives none of it
again.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain import checkpoint, memory
from megatrain.config import EngineSettings, TrainConfig
from megatrain.data import EvalSource, FileSource, SyntheticSource, make_sources
from megatrain.device import Device
from megatrain.distributed import Ranks, check as check_ranks, shared_memory_free
from megatrain.exports import checkpoints
from megatrain.io import check_writable
from megatrain.kernels import OPTIMIZER
from megatrain.optim import lr_factor
from megatrain.resolve import HOST_MEMORY_ENV, Machine, host_available_bytes, resolve
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.store import check_pretrained
from megatrain.units import GiB

# What a run writes in output_dir (runlog.py, save_state, save_pretrained): a new run there is
# refused while any is left from an earlier one, unless it resumes that run or overwrites it.
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "wandb", "state", "model", "best")

# Settings whose change alters what a resumed run means: the schedule's length and shape, the
# optimizer, the data and its order, the batch. Engine settings change how, not what.
MEANING = ("steps", "epochs", "seed", "optim", "data")


@dataclass(frozen=True)
class RunPlan:
    """Everything a run is decided to be before anything is allocated."""
    cfg: TrainConfig
    ranks: Ranks
    shape: ModelShape
    device: Device | None  # None: planned for the GPU machine the settings state, not this one
    machine: Machine
    shared: int | None  # the shared-memory file system's free bytes, where the ranks' one store goes
    settings: EngineSettings
    memory_plan: memory.MemoryPlan
    data: FileSource | SyntheticSource | None  # None: not read, the run does not fit without it
    held_out: EvalSource | None
    total_steps: int | None  # None: counted in epochs of data not read
    refusal: memory.DoesNotFit | None

    @property
    def where(self) -> str:
        return "this machine" if self.device is not None else "the stated machine"

    def check(self) -> None:
        """Raise the refusal `train` stops at, if the run does not fit."""
        if self.refusal is not None:
            raise self.refusal

    @property
    def optimizer_note(self) -> str | None:
        """Why the host AdamW runs eager where engine.optimizer_kernel auto wanted its one pass."""
        why = self.machine.host_adamw_why_not
        if not OPTIMIZER.runs(self.settings) and why:
            return f"the host AdamW runs eager (several passes over memory): {why}"
        return None

    def describe(self) -> str:
        """The start-up summary (and the body of `megatrain plan`'s report)."""
        cfg, shape, s, plan, data = self.cfg, self.shape, self.settings, self.memory_plan, self.data
        d, c = cfg.data, shape.config
        model = cfg.model.pretrained or cfg.model.config or f"preset {cfg.model.preset}"
        lines = [f"model: {c.model_type} from {model}: {shape.total_params():,} parameters, "
                 f"{shape.num_layers} layers, hidden {shape.hidden}, vocabulary {shape.vocab}"
                 + (f"; {shape.experts} experts, {shape.top_k} per token: {shape.matmul_params():,} matmul "
                    f"parameters per token" + (f", router loss x {shape.router_aux_coef}" if shape.router_aux_coef else "")
                    if shape.experts else "")]
        if d.source == "file" and data is None:
            lines.append(f"data: {d.path or d.mix} ({d.format}), not read: the run does not fit without it")
        elif d.source == "file":
            dropped = {k: v for k, v in data.examples.dropped.items() if v}
            lines.append(f"data: {d.path or d.mix} ({d.format}): {len(data.examples):,} examples, "
                         f"{int(data.examples.lengths.sum()):,} tokens, {data.nbytes / GiB:.2f} GiB in host memory"
                         + (f"; left out: {dropped}" if dropped else "")
                         + (f"; cut to seq_len: {data.examples.truncated:,}" if data.examples.truncated else "")
                         + (f"; held out: {len(self.held_out.examples):,} examples" if self.held_out else ""))
            rows = "packed rows" if d.packing else "examples padded to the longest of their batch"
            if d.pad_to_multiple_of and (d.packing or d.batch_size > 1):  # collate's rule for padded batches
                rows += f" (padded widths: multiples of {d.pad_to_multiple_of})"
            epochs = self.total_steps * d.batch_size * d.grad_accum / data.rows_per_epoch()
            lines.append(f"step: {d.grad_accum} x {d.batch_size} {rows} of at most {d.seq_len} tokens: up to "
                         f"{d.grad_accum * d.batch_size * d.seq_len:,} tokens per step; {self.total_steps} steps "
                         f"({epochs:.2f} epochs)" + self._short_of_warmup())
        else:
            lines.append(f"data: synthetic; step: {d.grad_accum} x {d.batch_size} x {d.seq_len} = "
                         f"{d.grad_accum * d.batch_size * d.seq_len:,} tokens; {self.total_steps} steps"
                         + self._short_of_warmup())
        lines.append(f"engine: {s.device}, {s.compute_dtype} compute, {s.master_dtype} masters"
                     f"{' (split: shadow + low halves)' if s.split_masters else ''}, checkpoint every "
                     f"{s.checkpoint_every}, {s.device_tiles} device tiles, MLP chunk {s.mlp_chunk_tokens}, "
                     f"{s.no_recompute_layers} layers kept from recompute, "
                     f"{s.keep_attention_layers} keeping their attention"
                     + (f" ({s.offloaded_attention_layers} of them in host memory)" if s.offloaded_attention_layers
                        else "")
                     + (f"; {s.ranks} data-parallel ranks ({s.local_ranks} per host, sharing its host store), "
                        f"{d.batch_size // s.ranks} rows of each micro-batch per rank" if s.ranks > 1 else ""))
        host = {k: v for k, v in plan.detail.items() if not k.startswith("device.") and v}
        lines.append(f"memory plan: host {plan.host_bytes / GiB:.2f} GiB ("
                     + ", ".join(f"{k} {v / GiB:.2f}" for k, v in host.items())
                     + f"), device {plan.device_bytes / GiB:.2f} GiB")
        out = cfg.output_dir
        extra = ([f"{out}/checkpoint-N every {cfg.save_every} steps"
                  + (f" (the last {cfg.save_total_limit} kept)" if cfg.save_total_limit else "")] if cfg.save_every else []) \
            + ([f"{out}/best (by eval {cfg.metric_for_best_model})"] if cfg.metric_for_best_model else [])
        need = sum(save_bytes(cfg, shape).values()) / GiB
        lines.append(", ".join([f"outputs: {out}/metrics.jsonl", f"{out}/state", f"{out}/model", *extra])
                     + f" (at least {need:.1f} GiB of disk)" if out else "outputs: none (no output_dir)")
        return "\n".join(lines)

    def _short_of_warmup(self) -> str:
        """The summary's word where the run ends inside its warm-up: its learning rate never reaches
        optim.lr (a run of one step takes lr 0: the warm-up's first update is at 0)."""
        warmup, total = self.cfg.optim.warmup_steps, self.total_steps
        if total is None or warmup < total:
            return ""
        return (f"; WARNING: optim.warmup_steps {warmup} is not shorter than the run's {total} steps: the "
                f"learning rate never reaches optim.lr")


def plan_run(cfg: TrainConfig, ranks: Ranks = Ranks(), elsewhere: bool = False) -> RunPlan:
    """The run `cfg` describes, as this process's rank of `ranks` would train it. `elsewhere`
    (`megatrain plan`): where engine.device names a GPU and this machine has none, the plan of the
    GPU machine the settings state (engine.device_memory_gb, the host's size), to size one before
    renting it; else the run is planned for this machine, whose GPU it needs."""
    hf = model_config(cfg)
    shape = ModelShape(hf)
    limit = getattr(hf, "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise ValueError(f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings {limit}")
    check_output_dir(cfg, shape)
    # the schedule's arguments, before the data is read (a run in epochs has its length after)
    lr_factor(cfg.optim, cfg.steps or cfg.optim.warmup_steps + 1)
    if cfg.model.pretrained:
        check_pretrained(shape, Path(cfg.model.pretrained))
    if elsewhere and cfg.engine.device.startswith("cuda") and not torch.cuda.is_available():
        device, machine, shared = None, _stated_gpu_machine(cfg.engine, ranks.local_world), None
    else:
        device = Device(_rank_device(cfg.engine.device, ranks))
        machine = Machine.of(device, cfg.engine)
        shared = shared_memory_free() if ranks.distributed else None

    def settle(data_bytes: int) -> tuple[EngineSettings, memory.MemoryPlan, memory.DoesNotFit | None]:
        s = resolve(cfg.engine, cfg.data, cfg.optim, shape, machine, ranks, data_bytes)
        p = memory.plan(shape, s, data_bytes)
        try:
            memory.admit(p, machine.host_available, machine.device_free, shared, not machine.is_cuda)
        except memory.DoesNotFit as e:
            return s, p, e
        return s, p, None

    # the model is admitted before the data is read: a run that cannot fit costs no tokenising.
    # The data's bytes add to the host side only, so with them it would not fit either; they can
    # change only the host's choices (split masters, gradient slabs), decided again with them.
    s, p, refusal = settle(0)
    data = held_out = None
    if refusal is None and cfg.output_dir:  # a run that fits the machine: its saves, the disk
        _check_disk(cfg, shape, Path(cfg.output_dir))
    if refusal is None:
        data, held_out = make_sources(cfg.data, shape.vocab, cfg.model.pretrained)
        if data_bytes := data.nbytes + (held_out.nbytes if held_out else 0):
            s, p, refusal = settle(data_bytes)
    total = cfg.steps if cfg.steps is not None else data.steps_for(cfg.epochs) if data is not None else None
    if total is not None:
        lr_factor(cfg.optim, total)
    return RunPlan(cfg, ranks, shape, device, machine, shared, s, p, data, held_out, total, refusal)


def model_config(cfg: TrainConfig):
    """The run's `transformers` config, its `auto` attention the one of the device the run trains
    on (engine.device), not of whether this machine has a GPU: a CPU run on a GPU machine takes
    eager attention as on any CPU, and a plan made on a CPU machine for a GPU one that GPU's (for
    GPT-OSS flex attention, whose memory is linear in the sequence, not eager attention's square)."""
    name = cfg.engine.device
    return load_hf_config(cfg.model, cuda=name.startswith("cuda") or (name == "auto" and torch.cuda.is_available()))


def earlier_outputs(out: Path) -> list[Path]:
    """The run outputs in `out`, with the copies a save cut short between its renames left, and the
    one a save keeps until the next step's loss is judged (io.atomic_dir)."""
    names = [*RUN_OUTPUTS, *(p.name for _, p in checkpoints(out))]
    return [p for name in names for p in (out / name, out / f".{name}.old", out / f".{name}.previous")
            if p.exists()]


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


def check_output_dir(cfg: TrainConfig, shape: ModelShape) -> None:
    """output_dir can be written, holds no earlier run's outputs unless resumed or overwritten, and
    resume has a state to resume, saved by a run of the same meaning."""
    if not cfg.output_dir:
        return
    out = Path(cfg.output_dir)
    check_writable(out, "output_dir")
    earlier = earlier_outputs(out) if not (cfg.resume or cfg.overwrite) else []
    if earlier:
        raise ValueError(f"output_dir {out} holds an earlier run's {', '.join(p.name for p in earlier)}: "
                         f"resume=true continues that run, overwrite=true replaces it, or name another output_dir")
    if cfg.resume:
        saved = checkpoint.saved_state(out / "state")
        if saved is None:
            earlier = earlier_outputs(out)  # a run killed before its first save was whole
            raise ValueError(f"resume=true: no saved training state in {out} (nothing to resume; " + (
                f"it holds an earlier run's {', '.join(p.name for p in earlier)} but no complete save: "
                f"overwrite=true instead of resume=true starts the run afresh, replacing them)" if earlier else
                "leave resume unset to start the run)"))
        changes = meaning_changes(checkpoint.check_state(shape, saved)["config"], cfg)
        if changes and not cfg.resume_changes:
            raise ValueError(f"resume=true: this run's settings differ from the saved run's in {'; '.join(changes)}; "
                             f"set resume_changes=true to resume with them anyway")


def save_bytes(cfg: TrainConfig, shape: ModelShape) -> dict[str, int]:
    """The least disk the run's saves need in output_dir at their fullest: the training state
    (masters in engine.master_dtype, both moments in float32), twice where a run saves it more than
    once (a save writes the new state before it drops the old: io.atomic_dir), and the model in
    save_dtype, once more for each checkpoint-N kept (one where save_total_limit leaves them all)."""
    params = shape.total_params()
    state = params * ((4 if cfg.engine.master_dtype == "float32" else 2) + 8)
    model = params * (4 if cfg.save_dtype == "float32" else 2)
    repeated = cfg.save_every is not None
    return {"state": state * (2 if repeated else 1),
            "model": model * (1 + ((cfg.save_total_limit or 1) if repeated else 0))}


def _check_disk(cfg: TrainConfig, shape: ModelShape, out: Path) -> None:
    """Refuse a run whose saves cannot fit output_dir's disk, before it trains (a 7B's state is 91 GB)."""
    need = save_bytes(cfg, shape)
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if cfg.overwrite:  # removed before the run starts
        free += sum(f.stat().st_size for p in earlier_outputs(out)
                    for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    if sum(need.values()) > free:
        raise ValueError(f"output_dir {out}: the run's saves need at least {sum(need.values()) / GiB:.1f} GiB "
                         f"(training state {need['state'] / GiB:.1f}, model {need['model'] / GiB:.1f} in "
                         f"{cfg.save_dtype}), and its disk has {free / GiB:.1f} GiB free: name an output_dir on a "
                         f"larger disk" + (", or save less often (save_every, save_total_limit)" if cfg.save_every else ""))


def _stated_gpu_machine(engine, gpus: int) -> Machine:
    """A GPU machine this one is not, as engine.device_memory_gb and the stated host size say."""
    missing = [k for k, v in (("engine.device_memory_gb", engine.device_memory_gb),
                              ("engine.host_memory_gb", engine.host_memory_gb or os.environ.get(HOST_MEMORY_ENV)))
               if v is None]
    if missing:
        raise ValueError(f"engine.device is {engine.device!r} but this machine has no GPU: to plan for a GPU "
                         f"machine, state {' and '.join(missing)}")
    return Machine(True, int(engine.device_memory_gb * GiB), host_available_bytes(engine.host_memory_gb), gpus)


def _rank_device(name: str, ranks: Ranks) -> str:
    """One GPU per rank: the host's local rank picks it (engine.device auto or cuda)."""
    if not ranks.distributed or name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return name
    check_ranks(ranks, 0, "cuda", torch.cuda.device_count())  # more ranks than GPUs: refused by name
    if name not in ("auto", "cuda", f"cuda:{ranks.local_rank}"):
        raise ValueError(f"engine.device {name!r} names one GPU; under torchrun each rank takes the GPU of its "
                         f"LOCAL_RANK: set engine.device to auto or cuda")
    return f"cuda:{ranks.local_rank}"
