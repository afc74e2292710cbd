"""The run spec every system shares: which model, which batch, how many steps, which options.

A spec is plain data (JSON in, JSON out) so that a point can be handed to its own process and
stored beside its result. Everything is validated before any process starts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from megatrain.config import DataConfig, ModelConfig, TrainConfig, load_config
from suite.system import SYSTEMS


@dataclass(frozen=True)
class RunSpec:
    system: str
    model: dict[str, Any]  # a megatrain ModelConfig: {preset | config | pretrained, overrides}
    seq_len: int = 4096
    batch_size: int = 1  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    steps: int = 5  # measured steps at least, after the warm-up: the window the medians are of
    warmup: int = 2
    # measured steps at most: more than `steps` are taken until the last `steps` agree within
    # steady_spread (suite/timing.py); None: 4 x steps, or steps where the count is fixed (fixed_count)
    max_steps: int | None = None
    steady_spread: float = 0.05  # the window's range over its median that counts as steady
    smoke: bool = False  # a check that the point runs, whose timing is never judged (the CPU grid's)
    seed: int = 0
    lr: float = 1e-5
    # AdamW's other settings, the same for every system (decay on matrices only, as MegaTrain does)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    repeat_batch: bool = False  # the same batch every step (the loss-tracking check)
    timeout_s: float = 1800.0
    options: dict[str, Any] = field(default_factory=dict)  # the system's own settings
    # a local data file instead of synthetic tokens: megatrain DataConfig fields (path, format,
    # prompt_field, response_field, tokenizer, ...); batches drawn in the same seeded order for every system
    data: dict[str, Any] | None = None
    save_to: str | None = None  # after the steps, save the trained weights there as a transformers checkpoint
    # data-parallel ranks, one per GPU, under torchrun (the systems registered data_parallel in suite.system.SYSTEMS);
    # batch_size stays the global micro-batch's, which the ranks split
    gpus: int = 1

    def __post_init__(self):
        if self.system not in SYSTEMS:
            raise ValueError(f"system: unknown {self.system!r}; known: {list(SYSTEMS)}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "gpus"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.seq_len < 2:
            raise ValueError("seq_len: must be at least 2 (a sequence of one token predicts nothing)")
        if self.gpus > 1 and not SYSTEMS[self.system].data_parallel:
            parallel = ", ".join(name for name, r in SYSTEMS.items() if r.data_parallel)
            raise ValueError(f"gpus: {self.system} runs on one GPU in this harness; only {parallel} "
                             f"run data-parallel")
        if self.batch_size % self.gpus:
            raise ValueError(f"batch_size {self.batch_size} does not split over gpus {self.gpus}: make it a multiple")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < self.steps):
            raise ValueError(f"max_steps: must be an integer of at least steps ({self.steps}), got {self.max_steps!r}")
        if self.max_steps is not None and self.max_steps > self.steps and self.fixed_count:
            raise ValueError(f"max_steps {self.max_steps}: this point's step count is fixed (a data file, saved "
                             f"weights, the repeated batch, a smoke point or {self.system}'s fixed script): "
                             "leave max_steps unset")
        if not (isinstance(self.steady_spread, (int, float)) and self.steady_spread > 0):
            raise ValueError(f"steady_spread: must be a positive fraction, got {self.steady_spread!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup: must be a non-negative integer, got {self.warmup!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be positive, got {self.lr!r}")
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"betas: must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))  # a JSON list comes back a tuple
        if not self.eps > 0:
            raise ValueError(f"eps: must be positive, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay: must be non-negative, got {self.weight_decay!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be positive, got {self.timeout_s!r}")
        if self.data is not None:
            if self.repeat_batch:
                raise ValueError("repeat_batch applies to synthetic data, not to a data file")
            self.data_config()  # a missing file or a bad field fails here
        hf = self.hf_config()  # an unknown preset, a missing config or a bad override fails here
        if self.system == "megatrain":  # its engine settings through megatrain's own loader, before a worker starts
            self.megatrain_config()
        limit = getattr(hf, "max_position_embeddings", None)
        if limit is not None and self.seq_len > limit:
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's max_position_embeddings {limit}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"run spec: unknown keys {unknown}; known: {sorted(names)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def stored(cls, values: dict[str, Any]) -> dict[str, Any]:
        """A spec as a result stores it (JSON), with the defaults of the fields added since it was
        written: a result of an older version compares equal to the same run specified today."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        return json.loads(json.dumps({**defaults, **values}))

    def runs_as(self, other: "RunSpec") -> bool:
        """Whether `other` runs what this spec runs: the same model once resolved (`layers: 28` of a
        28-layer preset is the preset) and every other field the same, but the timeout."""
        return (dataclasses.replace(self, model=other.model, timeout_s=other.timeout_s) == other
                and self.hf_config(cuda=False).to_dict() == other.hf_config(cuda=False).to_dict())

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig(**self.model)
        except TypeError as e:
            raise ValueError(f"model: {e}") from None

    def hf_config(self, cuda: bool | None = None):
        """`cuda`: plan for a machine with a GPU or without one (None: this machine)."""
        from megatrain.shapes import load_hf_config  # transformers and torch: only where a spec is checked
        return load_hf_config(self.model_config(), cuda)

    def megatrain_config(self, device: str = "auto") -> TrainConfig:
        """The run as MegaTrain's TrainConfig (baselines/megatrain.py trains it on `device`): the
        options' `engine` settings and `max_grad_norm` read by megatrain.config's loader, which
        names an unknown key or a bad value."""
        engine = self.options.get("engine", {})
        if not isinstance(engine, dict):
            raise ValueError(f"megatrain options: engine must be a mapping of engine settings, not {engine!r}")
        tree = {
            "model": self.model,
            "engine": {"device": device, **engine},
            "optim": {"lr": self.lr, "schedule": "constant", "warmup_steps": 0, "weight_decay": self.weight_decay,
                      "betas": list(self.betas), "eps": self.eps, "max_grad_norm": self.options.get("max_grad_norm")},
            "data": {"source": "synthetic", "seq_len": self.seq_len, "batch_size": self.batch_size,
                     "grad_accum": self.grad_accum, "seed": self.seed, "repeat_batch": self.repeat_batch},
            "steps": self.total_steps,
            "seed": self.seed,
        }
        try:
            return load_config(None, [], base=tree)
        except ValueError as e:
            raise ValueError(f"megatrain options: {e}") from None

    def data_config(self) -> DataConfig:
        common = dict(seq_len=self.seq_len, batch_size=self.batch_size, grad_accum=self.grad_accum, seed=self.seed)
        if self.data is None:
            return DataConfig(source="synthetic", repeat_batch=self.repeat_batch, **common)
        unknown = sorted(set(self.data) - {f.name for f in dataclasses.fields(DataConfig)})
        if unknown or set(self.data) & set(common) or "source" in self.data:
            raise ValueError(f"data: give the file's fields (path, format, tokenizer, ...); not {sorted(self.data)}")
        return DataConfig(source="file", **self.data, **common)

    def model_flops_per_step(self) -> float:
        """The model FLOPs of one step, every sequence seq_len long (the one formula:
        megatrain.metrics.model_flops)."""
        from megatrain.metrics import model_flops
        from megatrain.shapes import ModelShape
        shape = ModelShape(self.hf_config())
        sequences = [self.seq_len] * (self.batch_size * self.grad_accum)
        return model_flops(shape.matmul_params(), shape.attention(), sequences)

    @property
    def fixed_count(self) -> bool:
        """Whether the point takes exactly `steps`: a training run on a data file or one that saves its
        weights, the loss check's repeated batch, a system that runs a fixed script (their count is
        their meaning), a smoke point (its timing is never judged)."""
        return (self.data is not None or self.save_to is not None or self.repeat_batch or self.smoke
                or SYSTEMS[self.system].fixed_steps)

    @property
    def measured_steps_limit(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return self.steps if self.fixed_count else 4 * self.steps

    @property
    def total_steps(self) -> int:
        """The most steps the point takes, its warm-up included."""
        return self.warmup + self.measured_steps_limit

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.grad_accum

    def key(self) -> str:
        """A short stable name for the point (system, model, batch, and a hash of the rest)."""
        model = self.model.get("preset") or "model"
        digest = hashlib.sha1(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
        return f"{self.system}-{model}-s{self.seq_len}-b{self.batch_size}x{self.grad_accum}-{digest}"
