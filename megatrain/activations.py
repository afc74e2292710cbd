"""Block checkpoints: the input of every K-th layer for each micro-batch, kept from the forward
pass for the backward's recomputation.

On the device they grow with depth (one per block). Offloaded, each returns to pinned host memory
on the gradient stream as the forward produces it, and comes back on the weight stream one block
ahead of the backward that needs it: the device then holds two blocks' checkpoints at most,
whatever the depth, for one more crossing of the link per block each way.
"""
from __future__ import annotations

import torch

from megatrain.device import Device
from megatrain.timeline import Kind, Timeline, Track


class Checkpoints:
    def __init__(self, device: Device, timeline: Timeline, offload: bool):
        self.dev, self.timeline, self.offload = device, timeline, offload
        self.kept: dict[int, list[torch.Tensor]] = {}  # block start -> device tensors (or in flight)
        self.ready: dict[int, object] = {}  # block start -> H2D-done event
        self.host: dict[int, list[torch.Tensor]] = {}  # block start -> pinned copies, reused every step
        self.bytes_h2d = self.bytes_d2h = 0

    def put(self, start: int, hs: list[torch.Tensor]) -> None:
        """Keep the inputs of the block starting at layer `start` (after the forward issued them)."""
        if not self.offload:
            self.kept[start] = hs
            return
        host = self.host.get(start)
        if host is None or [t.shape for t in host] != [h.shape for h in hs]:
            host = self.host[start] = [torch.empty(h.shape, dtype=h.dtype, pin_memory=self.dev.is_cuda) for h in hs]
        done = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.d2h):
            self.dev.wait(self.dev.d2h, done)
            with self.timeline.stream(Track.D2H, self.dev.d2h, Kind.CHECKPOINT, f"L{start}"):
                for h, dst in zip(hs, host):
                    dst.copy_(h, non_blocking=True)
                    if self.dev.is_cuda:
                        h.record_stream(self.dev.d2h)
        self.bytes_d2h += sum(h.numel() * h.itemsize for h in hs)

    def prefetch(self, start: int) -> None:
        """Start bringing the block's checkpoints back (no-op when they stayed on the device)."""
        if not self.offload or start in self.kept:
            return
        host = self.host[start]
        dst = [torch.empty(h.shape, dtype=h.dtype, device=self.dev.torch) for h in host]
        allocated = self.dev.record(self.dev.compute)  # the memory's previous user has run
        with self.dev.on(self.dev.h2d):
            self.dev.wait(self.dev.h2d, allocated)
            with self.timeline.stream(Track.H2D, self.dev.h2d, Kind.CHECKPOINT, f"L{start}"):
                for h, d in zip(host, dst):
                    d.copy_(h, non_blocking=True)
            self.ready[start] = self.dev.record(self.dev.h2d)
        self.kept[start] = dst
        self.bytes_h2d += sum(h.numel() * h.itemsize for h in host)

    def take(self, start: int) -> list[torch.Tensor]:
        """The block's checkpoints on the device; the compute stream waits for their copy."""
        self.prefetch(start)
        if start in self.ready:
            self.dev.wait(self.dev.compute, self.ready.pop(start))
        return self.kept.pop(start)
