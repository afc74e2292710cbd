"""The CPU optimizer: AdamW on the host, with optional global-norm clipping, in a worker thread that
overlaps the device's work.

Every tile's gradient is summed over the step's micro-batches on the device and returns once per
step, in float32, as slab-sized pieces of the tile. Without clipping a piece updates its range of
the tile straight from the pinned slab, during the backward pass: the host stores no gradient.

With clipping the update needs the global norm, so every piece is copied into its tile's gradient
buffer and all updates wait for the step's end; they then run in the order the next step's
forward reads the tiles, and the weight stream waits per tile (`Tile.ready`), so the updates
overlap the next step's forward instead of stalling the device for the whole optimizer.
The squared norms are taken on the device and arrive with the step's end.

Without clipping the pieces are not applied in the order they arrive. The backward returns the
tiles last-first, and the next forward reads them first-first: where the CPU's AdamW is slower than
the backward, a first-come order leaves the first layers' updates for last, and the next step
waits for all of them. The worker instead applies, of the pieces whose copy has landed, the one
the next forward reads first; the pieces it leaves hold their slabs, so the backward runs ahead
by up to the slabs' count, and what is left at the step's end is the last layers' updates, which
overlap the next forward (docs/decisions.md, "The CPU optimizer's order").
"""
from __future__ import annotations

import itertools
import json
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatrain import fused_adamw
from megatrain.config import OptimConfig
from megatrain.store import Storage, Tile, join, split
from megatrain.timeline import Kind, Timeline, Track

CHUNK = 1 << 24  # elements per fused AdamW call (measured on the H100 host: 1 << 20 is 25% slower)
SCRATCH_BYTES = CHUNK * (4 + 4)  # Scratch: a float32 master chunk and its int32 low halves


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


def clip_scale(max_norm: float, norm: float | torch.Tensor) -> float | torch.Tensor:
    """The factor global-norm clipping puts on every gradient, as torch's clip_grad_norm_: a float
    from the host tiles' norm, a tensor from the device tiles' (read on the device, no sync)."""
    scale = max_norm / (norm + 1e-6)
    return scale.clamp(max=1.0) if isinstance(scale, torch.Tensor) else min(1.0, scale)


class Scratch:
    """What a split tile's chunk is joined into for its update: a float32 master and an int32 widening
    of its low halves, CHUNK elements each (SCRATCH_BYTES, allocated at first use)."""

    def __init__(self):
        self.param = self.wide = None

    def take(self, tile: Tile, a: int, b: int) -> torch.Tensor:
        if self.param is None:
            self.param, self.wide = torch.empty(CHUNK), torch.empty(CHUNK, dtype=torch.int32)
        return join(tile.shadow[a:b], tile.low[a:b], tile.exp_avg_sq[a:b], self.param[: b - a], self.wide[: b - a],
                    take=True)


def adamw(tile: Tile, lo: int, hi: int, grad: torch.Tensor, step: int, lr: float, cfg: OptimConfig,
          grad_scale: float, found_inf: torch.Tensor | None = None, scratch: Scratch | None = None,
          compiled: bool = False) -> None:
    """One AdamW update of elements [lo, hi) of a tile from `grad` (float32, hi - lo elements),
    then refresh that range of the shadow. A device tile's runs on the current stream; its
    `found_inf` (a float32 scalar there, nonzero when the gradient is not finite) makes the kernel
    leave weights and moments as they are, without a host sync. `compiled`: a host tile with
    float32 masters updates in one pass over memory (fused_adamw.py), the same numbers as the
    eager update's; else a split tile's master is joined chunk by chunk into `scratch`, updated
    there by torch's fused AdamW and split back."""
    decay_end = tile.layout.decay_numel if cfg.decay == "matrices" else tile.layout.numel
    beta1, beta2 = cfg.betas
    fp32_master = tile.master_dtype == torch.float32
    one_pass = compiled and fp32_master and not tile.on_device
    if tile.storage is Storage.SPLIT and scratch is None and not one_pass:
        scratch = Scratch()
    if grad_scale != 1.0 and not one_pass:
        grad.mul_(grad_scale)
    # torch's fused AdamW is called per chunk and per decay, and the one pass on the same pieces:
    # the elements past a call's last full vector take its scalar formula
    for a0 in range(lo, hi, CHUNK):
        b0 = min(hi, a0 + CHUNK)
        if one_pass:
            for a, b, wd in ((a0, min(b0, decay_end), cfg.weight_decay), (max(a0, decay_end), b0, 0.0)):
                if a < b:
                    split_tile = tile.storage is Storage.SPLIT
                    shadow = None if tile.storage is Storage.MASTER_IS_SHADOW else tile.shadow[a:b]
                    fused_adamw.update(grad[a - lo: b - lo], tile.exp_avg[a:b], tile.exp_avg_sq[a:b], step, lr, wd, cfg,
                                       grad_scale, master=None if split_tile else tile.master[a:b], shadow=shadow,
                                       low=tile.low[a:b] if split_tile else None)
            continue
        if tile.storage is Storage.SPLIT:
            param = scratch.take(tile, a0, b0)
        else:
            param = tile.master[a0:b0] if fp32_master else tile.master[a0:b0].float()
        # the decayed matrices come first in the layout: split the chunk at decay_end
        for a, b, wd in ((a0, min(b0, decay_end), cfg.weight_decay), (max(a0, decay_end), b0, 0.0)):
            if a >= b:
                continue
            torch._fused_adamw_(
                [param[a - a0: b - a0]], [grad[a - lo: b - lo]], [tile.exp_avg[a:b]], [tile.exp_avg_sq[a:b]],
                [], [torch.full((), float(step), device=param.device)], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                eps=cfg.eps, amsgrad=False, maximize=False, found_inf=found_inf)
        if tile.storage is Storage.SPLIT:
            split(param, tile.shadow[a0:b0], tile.low[a0:b0], tile.exp_avg_sq[a0:b0])
        elif not fp32_master:
            tile.master[a0:b0].copy_(param)
        tile.refresh_shadow(a0, b0)


@dataclass(frozen=True)
class _Begin:
    expected: dict[Tile, int]  # gradient pieces each tile gets this step


@dataclass(frozen=True)
class _Dense:
    landed: object  # device event: the D2H copies into `grad` and `norm_sq` have completed
    tile: Tile
    lo: int
    hi: int
    grad: torch.Tensor
    release: Callable[[], None]
    norm_sq: torch.Tensor  # the squared gradient norm of the tile (of this rank's part): not finite, no piece applied


@dataclass(frozen=True)
class _Finish:
    landed: object  # device event: `sq_norms` is on the host
    sq_norms: torch.Tensor


class OptimizerWorker:
    def __init__(self, tiles: list[Tile], cfg: OptimConfig, total_steps: int, timeline: Timeline,
                 parts: dict[Tile, tuple[int, int]] | None = None, published: Callable[[Tile], None] | None = None,
                 compiled: bool = False):
        """`parts`: the elements [lo, hi) of each tile this worker updates (data-parallel ranks
        share the others: distributed.py), default all; `published(tile)`: called once this
        worker's part of a tile is written, before the tile's `ready` is set; `compiled`: the
        one-pass update where it applies (adamw)."""
        self.compiled = compiled
        self.threads = torch.get_num_threads()  # the worker's own OpenMP team, for compiled code too
        self.tiles = tiles  # in the order the forward reads them
        self.order = {tile: k for k, tile in enumerate(tiles)}
        self.parts = parts or {tile: (0, tile.layout.numel) for tile in tiles}
        self.published = published
        self.timeline = timeline
        self.cfg = cfg
        self.total_steps = total_steps
        self.updates_done = 0  # optimizer steps completed (Adam's step count), worker side
        self.steps_begun = 0  # steps the main thread has started
        self.grad_norms: dict[int, float] = {}  # by update number (0-based), before clipping
        self.busy_s = 0.0  # seconds the worker spent in tasks since the step began
        self._scratch = Scratch()
        self._tasks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatrain-optimizer", daemon=True)
        self._thread.start()

    # ---- main thread ----
    def begin_step(self, expected: dict[Tile, int]) -> None:
        """Declare how many gradient contributions each tile gets this step."""
        self._check()
        self.steps_begun += 1
        self._expected = dict(expected)
        self._submitted = {tile: 0 for tile in expected}
        self._put(_Begin(dict(expected)))

    def submit_dense(self, tile: Tile, lo: int, hi: int, grad: torch.Tensor, event,
                     release: Callable[[], None], norm_sq: torch.Tensor) -> None:
        """Elements [lo, hi) of a tile's step gradient, float32 in `grad` once `event` completes,
        with the tile's squared norm."""
        self._put(_Dense(event, tile, lo, hi, grad, release, norm_sq))
        self._count(tile)

    def finish_step(self, sq_norms: torch.Tensor, event) -> None:
        """All of the step's gradients are submitted; `sq_norms` (each tile's squared gradient
        norm, on the host once `event` completes) gives the global norm: clip and update."""
        self._put(_Finish(event, sq_norms))

    def flush(self) -> None:
        """Wait until every submitted task is done."""
        self._tasks.join()
        self._check()

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def _count(self, tile: Tile) -> None:
        self._submitted[tile] += 1
        if self._submitted[tile] == self._expected[tile]:
            tile.ready.clear()  # from now until its update is written, nobody may stream it

    def _put(self, task) -> None:
        self._check()
        self._tasks.put(task)

    def _check(self) -> None:
        if self._error is not None:
            e = self._error
            raise RuntimeError(f"the optimizer worker failed: {type(e).__name__}: {e}") from e

    # ---- worker thread ----
    def _next(self, pending: list) -> object:
        """The next task to run. Everything queued is taken into `pending` (blocking only when
        nothing is pending); a step's begin and finish run in their place, and of the gradient
        pieces before them, the landed one that the next forward reads first, else the oldest."""
        while True:
            try:
                pending.append(self._tasks.get(block=not pending))
            except queue.Empty:
                break
        pieces = itertools.takewhile(lambda k: isinstance(pending[k], _Dense), range(len(pending)))
        landed = [k for k in pieces if pending[k].landed.query()]
        pick = min(landed, key=lambda k: (self.order[pending[k].tile], pending[k].lo), default=0)
        return pending.pop(pick)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        handlers = {_Begin: self._do_begin, _Dense: self._do_dense, _Finish: self._do_finish}
        pending = []  # tasks taken from the queue, in their order, not yet run
        while (task := self._next(pending)) is not None:
            try:
                if self._error is None:
                    if not isinstance(task, _Begin):
                        task.landed.synchronize()  # the D2H copy has landed
                    start = time.perf_counter()
                    kind, label = ((Kind.UPDATE, f"{task.tile.name} [{task.lo}:{task.hi}]") if isinstance(task, _Dense)
                                   else (Kind.OPTIMIZER_STEP, type(task).__name__[1:].lower()))
                    with self.timeline.host(Track.OPTIMIZER, kind, label):
                        handlers[type(task)](task)
                    self.busy_s += time.perf_counter() - start
                elif isinstance(task, _Dense):
                    task.release()  # skipped: its slab goes back all the same
            except BaseException as e:  # surfaced on the main thread's next call
                self._error = e
                # what the main thread may be blocked on until this worker publishes: it wakes,
                # reaches its next call here and raises this error (no step that read a tile
                # this worker left un-updated completes)
                for tile in self.tiles:
                    tile.ready.set()
            finally:
                self._tasks.task_done()
        self._tasks.task_done()

    def _do_begin(self, task: _Begin) -> None:
        self._left = task.expected
        self._received = {tile: 0 for tile in task.expected}
        self.busy_s = 0.0

    def _do_dense(self, task: _Dense) -> None:
        tile = task.tile
        try:
            if not math.isfinite(float(task.norm_sq)):  # a NaN or an infinity in the tile's gradient
                pass  # never applied: the engine stops the run at the step's end
            elif self.cfg.max_grad_norm is None:  # update this range now, from the slab
                self._update(tile, task.lo, task.hi, task.grad, 1.0)
            else:  # each element's one contribution of the step (a unit returns once per step)
                tile.grad[task.lo:task.hi].copy_(task.grad)
        finally:
            task.release()  # the slab back, also when the update fails (the main thread may wait for one)
        self._received[tile] += 1
        if self._received[tile] == self._left[tile] and self.cfg.max_grad_norm is None:
            self._done(tile)

    def _do_finish(self, task: _Finish) -> None:
        norm = self.grad_norms[self.updates_done] = math.sqrt(float(task.sq_norms.sum()))
        if self.cfg.max_grad_norm is not None:
            scale = clip_scale(self.cfg.max_grad_norm, norm)
            for tile in self.tiles:
                lo, hi = self.parts[tile]
                if math.isfinite(norm):  # else no tile is updated from a gradient holding a NaN or inf
                    self._update(tile, lo, hi, tile.grad[lo:hi], scale)
                self._done(tile)
        self.updates_done += 1

    def _update(self, tile: Tile, lo: int, hi: int, grad: torch.Tensor, scale: float) -> None:
        if tile.read_done is not None:
            tile.read_done.synchronize()  # an H2D copy may still be reading the shadow
        lr = lr_at(self.updates_done, self.cfg, self.total_steps)
        adamw(tile, lo, hi, grad, self.updates_done + 1, lr, self.cfg, scale, scratch=self._scratch,
              compiled=self.compiled)

    def _done(self, tile: Tile) -> None:
        if self.published is not None:
            self.published(tile)
        self._publish(tile)

    @staticmethod
    def _publish(tile: Tile) -> None:
        tile.version += 1
        tile.ready.set()

