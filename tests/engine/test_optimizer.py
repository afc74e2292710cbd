"""The CPU optimizer (megatrain/host_executor.py, adamw.py): its AdamW applied range by range equals torch.optim.AdamW,
and its order: of the gradient pieces waiting, the one the next forward reads first."""
import threading

import torch

from megatrain.config import OptimConfig
from megatrain.device import Device
from megatrain.adamw import Update
from megatrain.host_executor import HostExecutor
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile
from megatrain.timeline import Timeline


class HeldCopy:
    """A D2H copy that lands when the test says so."""

    def __init__(self):
        self.landed = threading.Event()
        self.waited_on = threading.Event()

    def query(self) -> bool:
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.waited_on.set()
        self.landed.wait()


def test_waiting_pieces_go_in_the_next_forwards_order():
    """While the worker is held on one piece, three more come in the backward's order (last layer
    first): it applies them first layer first; a first-come order would have applied layer 3
    first, and the next step's forward, which reads layer 1 first, would have waited for all."""
    tiles = [Tile(f"layer.{k}", Layout.of([ParamSpec("w", (8,))]), torch.float32, torch.bfloat16,
                  pinned=False, grad=False) for k in range(5)]
    for tile in tiles:
        tile.reset()
    order, first, held, late = [], HeldCopy(), HeldCopy(), HeldCopy()

    def published(tile: Tile) -> None:
        order.append(tile.name)
        if tile.name == "layer.3":  # layer 2's copy lands only now, after the others were chosen
            late.landed.set()

    worker = HostExecutor(tiles, Timeline(Device("cpu"), False), None, published=published)
    try:
        worker.begin_step({tile: 1 for tile in tiles}, Update(1, 1e-3, OptimConfig(max_grad_norm=None)))
        norm = torch.zeros((), dtype=torch.float64)
        worker.submit(tiles[4], 0, 8, torch.ones(8), first, lambda: None, norm)
        assert first.waited_on.wait(10)  # the worker holds layer 4's piece
        for k, event in [(3, held), (1, held), (2, late), (0, held)]:
            worker.submit(tiles[k], 0, 8, torch.ones(8), event, lambda: None, norm)
        held.landed.set()
        first.landed.set()
        worker.flush()
        assert order == ["layer.4", "layer.0", "layer.1", "layer.3", "layer.2"]
        assert all(tile.version == 1 for tile in tiles)
    finally:
        worker.close()


def test_adamw_in_pieces_equals_torch_adamw(monkeypatch):
    """A tile updated range by range, in small chunks, with decayed and undecayed parts, equals
    torch.optim.AdamW on the same parameters."""
    from megatrain import adamw
    from megatrain.shapes import ParamSpec
    monkeypatch.setattr(adamw, "CHUNK", 100)
    specs = [ParamSpec("w", (30, 20)), ParamSpec("norm", (70,))]
    tile = Tile("t", Layout.of(specs), torch.float32, torch.float32, pinned=False, grad=False)
    gen = torch.Generator().manual_seed(0)
    tile.master.copy_(torch.randn(tile.layout.numel, generator=gen))
    tile.exp_avg.zero_()
    tile.exp_avg_sq.zero_()
    ref = [v.clone().requires_grad_() for v in tile.master_views()]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=1e-2, betas=cfg.betas, eps=cfg.eps)
    for step in range(1, 4):
        grad = torch.randn(tile.layout.numel, generator=gen)
        for r, view in zip(ref, tile.layout.views(grad)):
            r.grad = view.clone()
        opt.step()
        for lo, hi in ((0, 250), (250, 640), (640, tile.layout.numel)):  # pieces cut across both parameters
            adamw.adamw(tile, lo, hi, grad[lo:hi].clone(), adamw.Update(step, 1e-2, cfg))
    for r, view in zip(ref, tile.master_views()):
        torch.testing.assert_close(view, r.detach(), rtol=1e-6, atol=1e-7)


def test_each_updates_busy_time_counts_its_whole_update(monkeypatch):
    """The worker's busy seconds are kept by update: with clipping a step's update runs after the
    step (once its global norm is known), within the next one, and still counts as that step's.
    Each tile's update made to take 20 ms: every update's busy time holds its 3 tiles' 60 ms, with
    clipping and without."""
    import time

    from megatrain import host_executor
    real = host_executor.adamw

    def slow(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)
    monkeypatch.setattr(host_executor, "adamw", slow)
    landed = HeldCopy()
    landed.landed.set()
    for clip in (None, lambda norm: 1.0):
        tiles = [Tile(f"layer.{k}", Layout.of([ParamSpec("w", (8,))]), torch.float32, torch.bfloat16,
                      pinned=False, grad=clip is not None) for k in range(3)]
        for tile in tiles:
            tile.reset()
        worker = HostExecutor(tiles, Timeline(Device("cpu"), False), clip)
        try:
            for step in (1, 2):
                worker.begin_step({tile: 1 for tile in tiles}, Update(step, 1e-3, OptimConfig()))
                for tile in tiles:
                    if clip is not None:
                        tile.grad.fill_(1.0)
                    worker.submit(tile, 0, 8, None if clip else torch.ones(8), landed, lambda: None,
                                  torch.ones((), dtype=torch.float64))
                worker.finish_step(torch.full((3,), 1.0, dtype=torch.float64), landed)
            worker.flush()
            assert sorted(worker.busy) == [0, 1]
            assert all(seconds >= 0.06 for seconds in worker.busy.values()), (clip, worker.busy)
        finally:
            worker.close()
