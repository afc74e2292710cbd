"""One AdamW update of a range of a tile, by the tile's storage kind (store.Storage): torch's fused
AdamW on a float32 view of the master (a device tile's on the current stream), or on the chunk of
a split master joined for it, or the one-pass host kernel (fused_adamw.py). The same numbers on
every path: the host and device executors (host_executor.py, device_executor.py)
both call `adamw`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain import fused_adamw
from megatrain.config import OptimConfig
from megatrain.store import Storage, Tile, join, split

CHUNK = 1 << 24  # elements per fused AdamW call (measured on the H100 host: 1 << 20 is 25% slower)
SCRATCH_BYTES = CHUNK * (4 + 4)  # Scratch: a float32 master chunk and its int32 low halves


@dataclass(frozen=True)
class Update:
    """What one optimizer step's updates share, every tile's alike (optim.Optimizer makes it once a step)."""
    step: int  # 1-based: Adam's bias correction
    lr: float  # the schedule's rate for this step
    cfg: OptimConfig


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


def adamw(tile: Tile, lo: int, hi: int, grad: torch.Tensor, update: Update, grad_scale: float = 1.0,
          found_inf: torch.Tensor | None = None, scratch: Scratch | None = None, compiled: bool = False) -> None:
    """Update elements [lo, hi) of a tile from `grad` (float32, hi - lo elements) times
    `grad_scale`. A device tile's runs on the current
    stream; its `found_inf` (a float32 scalar there, nonzero when the gradient is not finite) makes
    the kernel leave weights and moments as they are, without a host sync. `compiled`: a host tile
    with float32 masters updates in one pass over memory (fused_adamw.py), the same numbers as the
    eager update's; else a split tile's master is joined chunk by chunk into `scratch`, updated
    there by torch's fused AdamW and split back."""
    cfg = update.cfg
    decay_end = tile.layout.decay_numel if cfg.decay == "matrices" else tile.layout.numel
    one_pass = compiled and tile.master_dtype == torch.float32 and not tile.on_device
    if tile.storage is Storage.SPLIT and scratch is None and not one_pass:
        scratch = Scratch()
    if grad_scale != 1.0 and not one_pass:
        grad.mul_(grad_scale)
    # torch's fused AdamW is called per chunk and per decay, and the one pass on the same pieces:
    # the elements past a call's last full vector take its scalar formula
    for a0 in range(lo, hi, CHUNK):
        b0 = min(hi, a0 + CHUNK)
        # the decayed matrices come first in the layout: split the chunk at decay_end
        parts = [(a, b, wd) for a, b, wd in ((a0, min(b0, decay_end), cfg.weight_decay), (max(a0, decay_end), b0, 0.0))
                 if a < b]
        if one_pass:
            for a, b, wd in parts:
                _one_pass(tile, a, b, grad[a - lo: b - lo], update, wd, grad_scale)
            continue
        param = _float_master(tile, a0, b0, scratch)
        for a, b, wd in parts:
            torch._fused_adamw_(
                [param[a - a0: b - a0]], [grad[a - lo: b - lo]], [tile.exp_avg[a:b]], [tile.exp_avg_sq[a:b]],
                [], [torch.full((), float(update.step), device=param.device)], lr=update.lr, beta1=cfg.betas[0],
                beta2=cfg.betas[1], weight_decay=wd, eps=cfg.eps, amsgrad=False, maximize=False, found_inf=found_inf)
        _store_master(tile, a0, b0, param)


def _one_pass(tile: Tile, a: int, b: int, grad: torch.Tensor, update: Update, wd: float, grad_scale: float) -> None:
    """The host kernel on elements [a, b) of a host tile with float32 masters (a split one's halves)."""
    split_ = tile.storage is Storage.SPLIT
    fused_adamw.update(grad, tile.exp_avg[a:b], tile.exp_avg_sq[a:b], update.step, update.lr, wd, update.cfg,
                       grad_scale, master=None if split_ else tile.master[a:b],
                       shadow=tile.shadow[a:b] if split_ else None, low=tile.low[a:b] if split_ else None)


def _float_master(tile: Tile, a: int, b: int, scratch: Scratch | None) -> torch.Tensor:
    """Elements [a, b) of the master as float32 for torch's fused AdamW: a view of a float32 master,
    else a copy (a split one joined into `scratch`, a bf16 one widened)."""
    if tile.storage is Storage.SPLIT:
        return scratch.take(tile, a, b)
    return tile.master[a:b] if tile.master_dtype == torch.float32 else tile.master[a:b].float()


def _store_master(tile: Tile, a: int, b: int, param: torch.Tensor) -> None:
    """The updated float32 `param` back where _float_master took it from."""
    if tile.storage is Storage.SPLIT:
        split(param, tile.shadow[a:b], tile.low[a:b], tile.exp_avg_sq[a:b])
    elif tile.master_dtype != torch.float32:
        tile.master[a:b].copy_(param)
