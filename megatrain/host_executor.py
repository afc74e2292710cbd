"""The host tiles' updates (optim.Optimizer's host executor): AdamW on the CPU, in a worker thread
that overlaps the device's work.

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

The worker is a thread beside the one that launches the device's kernels: an update must not hold
the GIL (the eager update's ops release it, the one-pass kernel is called through ctypes).
"""
from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatrain.adamw import Scratch, Update, adamw
from megatrain.store import Tile
from megatrain.timeline import Kind, Timeline, Track


@dataclass(frozen=True)
class _Begin:
    expected: dict[Tile, int]  # gradient pieces each tile gets this step
    update: Update


@dataclass(frozen=True)
class _Dense:
    landed: object  # device event: the D2H copies into `grad` (or the tile's buffer) and `norm_sq` have completed
    tile: Tile
    lo: int
    hi: int
    grad: torch.Tensor | None  # a slab; None with clipping: the range is in the tile's gradient buffer
    release: Callable[[], None]
    norm_sq: torch.Tensor  # the squared gradient norm of the tile (of this rank's part): not finite, no piece applied


@dataclass(frozen=True)
class _Finish:
    landed: object  # device event: `sq_norms` is on the host
    sq_norms: torch.Tensor


class HostExecutor:
    def __init__(self, tiles: list[Tile], timeline: Timeline, clip: Callable[[float], float] | None,
                 parts: dict[Tile, tuple[int, int]] | None = None, published: Callable[[Tile], None] | None = None,
                 compiled: bool = False):
        """`clip(norm)`: the factor on every gradient of a step of this global norm, None without
        clipping (pieces update at once); `parts`: the elements [lo, hi) of each tile this worker
        updates (data-parallel ranks share the others: distributed.py), default all;
        `published(tile)`: called once this worker's part of a tile is written, before the tile's
        `ready` is set; `compiled`: the one-pass update where it applies (adamw.py)."""
        self.clip = clip
        self.compiled = compiled
        self.threads = torch.get_num_threads()  # the worker's own OpenMP team, for compiled code too
        self.tiles = tiles  # in the order the forward reads them
        self.order = {tile: k for k, tile in enumerate(tiles)}
        self.parts = parts or {tile: (0, tile.layout.numel) for tile in tiles}
        self.published = published
        self.timeline = timeline
        self.grad_norms: dict[int, float] = {}  # by update number (0-based), before clipping
        self.busy: dict[int, float] = {}  # seconds in each update's tasks, by update number, once it ended
        self._busy_now = 0.0  # the running update's so far
        self._scratch = Scratch()
        self._tasks: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatrain-optimizer", daemon=True)
        self._thread.start()

    # ---- main thread ----
    def begin_step(self, expected: dict[Tile, int], update: Update) -> None:
        """Declare how many gradient contributions each tile gets this step, and the step's update."""
        self._check()
        self._expected = dict(expected)
        self._submitted = {tile: 0 for tile in expected}
        self._put(_Begin(dict(expected), update))

    def submit(self, tile: Tile, lo: int, hi: int, grad: torch.Tensor, event, release: Callable[[], None],
               norm_sq: torch.Tensor) -> None:
        """Elements [lo, hi) of a tile's step gradient, float32 in `grad` (None: in the tile's
        gradient buffer) once `event` completes, with the tile's squared norm."""
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
                    self._busy_now += time.perf_counter() - start
                    if isinstance(task, _Finish):  # the update's last task
                        self.busy[self._step_update.step - 1] = self._busy_now
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
        self._step_update = task.update
        self._busy_now = 0.0

    def _do_dense(self, task: _Dense) -> None:
        tile = task.tile
        try:
            if not math.isfinite(float(task.norm_sq)):  # a NaN or an infinity in the tile's gradient
                pass  # never applied: the engine stops the run at the step's end
            elif self.clip is None:  # update this range now, from the slab
                self._update(tile, task.lo, task.hi, task.grad, 1.0)
            # with clipping the range has landed in the tile's gradient buffer: updated at the finish
        finally:
            task.release()  # the slab back, also when the update fails (the main thread may wait for one)
        self._received[tile] += 1
        if self._received[tile] == self._left[tile] and self.clip is None:
            self._done(tile)

    def _do_finish(self, task: _Finish) -> None:
        norm = self.grad_norms[self._step_update.step - 1] = math.sqrt(float(task.sq_norms.sum()))
        if self.clip is not None:
            scale = self.clip(norm)
            for tile in self.tiles:
                lo, hi = self.parts[tile]
                if math.isfinite(norm):  # else no tile is updated from a gradient holding a NaN or inf
                    self._update(tile, lo, hi, tile.grad[lo:hi], scale)
                self._done(tile)

    def _update(self, tile: Tile, lo: int, hi: int, grad: torch.Tensor, scale: float) -> None:
        if tile.read_done is not None:
            tile.read_done.synchronize()  # an H2D copy may still be reading the master (or shadow)
        adamw(tile, lo, hi, grad, self._step_update, scale, scratch=self._scratch, compiled=self.compiled)

    def _done(self, tile: Tile) -> None:
        if self.published is not None:
            self.published(tile)
        self._publish(tile)

    @staticmethod
    def _publish(tile: Tile) -> None:
        tile.version += 1
        tile.ready.set()
