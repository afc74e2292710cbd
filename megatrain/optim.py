"""The optimizer: AdamW over every tile, with one owner of what a step's updates share. It counts
the steps (Adam's step number), gives each step its learning rate (transformers' schedules) and
takes the clipping's decision: without clipping a tile updates as soon as its step gradient is
complete, with it every update waits for the step's global norm, whose factor is computed by one
rule. The updates themselves run where the tile lives: a host tile's on the host executor (a worker
thread over the pinned gradient slabs: host_executor.py), a device tile's on the device executor
(the compute stream: device_executor.py), both through one AdamW (adamw.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable

import torch

from megatrain.adamw import Update
from megatrain.config import OptimConfig
from megatrain.device import Device
from megatrain.device_executor import DeviceExecutor, not_finite
from megatrain.host_executor import HostExecutor
from megatrain.store import Tile
from megatrain.timeline import Timeline


def schedule_arguments(cfg: OptimConfig) -> dict:
    """The schedule's arguments besides the warm-up and the length (get_scheduler's
    scheduler_specific_kwargs): optim.schedule_kwargs, and min_lr_ratio as the *_with_min_lr
    schedules' min_lr_rate."""
    kwargs = dict(cfg.schedule_kwargs)
    if cfg.schedule.endswith("_with_min_lr") and "min_lr" not in kwargs:
        kwargs.setdefault("min_lr_rate", 0.1 if cfg.min_lr_ratio is None else cfg.min_lr_ratio)
    return kwargs


def lr_factor(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The schedule's factor of lr by update number, transformers.get_scheduler's own function (the
    LambdaLR it builds over a throwaway optimizer); a bad schedule_kwargs is refused by name."""
    from transformers import get_scheduler
    # lr too: polynomial's factor is relative to the optimizer's lr (its lr_end is absolute)
    key = (cfg.schedule, cfg.lr, cfg.warmup_steps, total_steps, json.dumps(schedule_arguments(cfg), sort_keys=True))
    if key not in _FACTORS:
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
        try:
            scheduler = get_scheduler(cfg.schedule, dummy, num_warmup_steps=cfg.warmup_steps,
                                      num_training_steps=total_steps, scheduler_specific_kwargs=schedule_arguments(cfg))
        except (TypeError, ValueError) as e:  # an argument the schedule lacks or needs
            raise ValueError(f"optim.schedule {cfg.schedule} with optim.schedule_kwargs {cfg.schedule_kwargs}: {e}") from None
        _FACTORS[key] = scheduler.lr_lambdas[0]
    return _FACTORS[key]


_FACTORS: dict[tuple, Callable[[int], float]] = {}  # a schedule's function, once a process


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of update number `step` (0-based): lr times the schedule's factor, the product
    torch's LambdaLR forms, so an update's rate is the HF Trainer's to the bit."""
    return cfg.lr * lr_factor(cfg, total_steps)(step)


class Optimizer:
    def __init__(self, cfg: OptimConfig, total_steps: int, dev: Device, timeline: Timeline, host_tiles: list[Tile],
                 parts: dict[Tile, tuple[int, int]] | None = None, published: Callable[[Tile], None] | None = None,
                 compiled: bool = False):
        """`host_tiles`: in the order the forward reads them; `parts`, `published`, `compiled`: the
        host executor's (host_executor.py: data-parallel ranks' parts, their publication, the
        one-pass update)."""
        self.cfg, self.total_steps, self.dev = cfg, total_steps, dev
        self.clipping = cfg.max_grad_norm is not None  # then no update runs before the step's global norm is known
        self.steps = 0  # steps begun: the next one's update is number steps + 1 (a resume sets it)
        self.update: Update | None = None  # the step's, from begin_step
        self.host = HostExecutor(host_tiles, timeline, self.clip_scale if self.clipping else None, parts, published,
                                 compiled)
        self.device = DeviceExecutor(dev, timeline)

    def lr(self, t: int) -> float:
        """The learning rate of update number `t` (0-based)."""
        return lr_at(t, self.cfg, self.total_steps)

    def clip_scale(self, norm: float | torch.Tensor) -> float | torch.Tensor:
        """The factor global-norm clipping puts on every gradient of a step, as torch's
        clip_grad_norm_: a float from the host's copy of the norms (on the host executor's thread),
        a tensor from the device's (read on the device, no sync)."""
        scale = self.cfg.max_grad_norm / (norm + 1e-6)
        return scale.clamp(max=1.0) if isinstance(scale, torch.Tensor) else min(1.0, scale)

    # ---- a step, from the main thread ----
    def begin_step(self, expected: dict[Tile, int]) -> None:
        """A step begins: `expected`, the gradient pieces each host tile gets in it."""
        update = Update(self.steps + 1, self.lr(self.steps), self.cfg)
        self.host.begin_step(expected, update)
        self.update = update
        self.steps += 1

    def submit(self, tile: Tile, lo: int, hi: int, grad: torch.Tensor | None, event, release: Callable[[], None],
               norm_sq: torch.Tensor) -> None:
        """Elements [lo, hi) of a host tile's step gradient, float32 in the pinned slab `grad` (None
        with clipping: in the tile's pinned gradient buffer) once `event` completes (`release` gives
        the slab back), and the tile's squared norm, there by then too."""
        self.host.submit(tile, lo, hi, grad, event, release, norm_sq)

    def device_gradient(self, tile: Tile, grad: torch.Tensor, norm_sq: torch.Tensor) -> None:
        """A device tile's whole step gradient and its squared norm, on the device."""
        if self.clipping:
            self.device.keep(tile, grad)
        else:
            self.device.update(tile, grad, self.update, not_finite(norm_sq))

    def finish_step(self, sq: torch.Tensor, sq_host: torch.Tensor) -> None:
        """Every gradient of the step is in; `sq`, each tile's squared norm on the device, gives the
        global norm: the kept device tiles' updates on the compute stream, and `sq` copied into
        `sq_host` for the host executor's."""
        if self.device.kept:
            norm = sq.sum().sqrt()
            self.device.update_kept(self.update, self.clip_scale(norm).float(), not_finite(norm))
        sq_host.copy_(sq, non_blocking=True)
        self.host.finish_step(sq_host, self.dev.record(self.dev.compute))

    # ---- between steps ----
    @property
    def grad_norms(self) -> dict[int, float]:
        """Each step's global gradient norm before clipping, by update number (0-based), once its
        updates have run (`flush`)."""
        return self.host.grad_norms

    @property
    def busy(self) -> dict[int, float]:
        """Seconds the host executor spent in each update's tasks (the gradients' arrival, the
        update, with clipping all of it after the step's end), by update number (0-based), once
        its updates have run (`flush`)."""
        return self.host.busy

    def flush(self) -> None:
        """Wait until every update submitted is written (raises the host executor's error, if any)."""
        self.host.flush()

    def close(self) -> None:
        self.host.close()
