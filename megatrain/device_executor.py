"""The device tiles' updates (optim.Optimizer's device executor): AdamW on the compute stream, from
the tile's step gradient where the backward left it, with no host sync.

Without clipping a tile updates as soon as its gradient is complete, a gradient that is not finite
leaving it as it was (the kernel's `found_inf`); with clipping its gradient is kept until the
step's end, when the global norm, taken on the device, gives the scale.
"""
from __future__ import annotations

import torch

from megatrain.adamw import Update, adamw
from megatrain.device import Device
from megatrain.store import Tile
from megatrain.timeline import Kind, Timeline, Track


def not_finite(value: torch.Tensor) -> torch.Tensor:
    """1.0 where a device scalar is a NaN or an infinity, else 0.0: the fused AdamW's `found_inf`, read there."""
    return (~torch.isfinite(value)).float()


class DeviceExecutor:
    def __init__(self, dev: Device, timeline: Timeline):
        self.dev, self.timeline = dev, timeline
        self.kept: list[tuple[Tile, torch.Tensor]] = []  # the step's gradients awaiting the global norm

    def update(self, tile: Tile, grad: torch.Tensor, update: Update, found_inf: torch.Tensor) -> None:
        """The tile's update from its whole step gradient, on the compute stream; the loads that cast
        its master wait for the event it records."""
        with self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.UPDATE, tile.name):
            adamw(tile, 0, tile.layout.numel, grad, update, 1.0, found_inf)
        tile.version += 1
        tile.updated = self.dev.record(self.dev.compute)

    def keep(self, tile: Tile, grad: torch.Tensor) -> None:
        """The tile's step gradient, updated from by `update_kept` at the step's end."""
        self.kept.append((tile, grad))

    def update_kept(self, update: Update, scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """The kept gradients times `scale` (a float32 device scalar), each tile's update after."""
        for tile, grad in self.kept:
            grad.mul_(scale)
            self.update(tile, grad, update, found_inf)
        self.kept.clear()
