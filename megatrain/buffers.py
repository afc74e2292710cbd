"""Device buffers: the streaming weight buffers with their prefetcher, and the pinned gradient slabs.

A *unit* is what one compute op needs on the device: a decoder layer's tile, or the head (final
norm plus the LM head, which is the embedding tile when tied). The streamer gets the step's plan
(the unit each op uses, in order), merges consecutive uses of one unit into one load, and keeps
`nbuf - 1` loads ahead of compute: load k goes to slot k % nbuf, after the buffer-free event of
the load that last used that slot, and compute waits on its weights-ready event. A tile whose
master is not in the compute dtype (a whole float32 master with bf16 compute: store.py) is cast
on the device: copied as it is into a staging buffer of STAGE elements, a chunk at a time, and
cast from there into the weight buffer, on the load's stream.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import torch

from megatrain.device import Device
from megatrain.store import Tile
from megatrain.timeline import Kind, Timeline, Track

STAGE = 1 << 24  # elements a cast load stages on the device at a time (64 MB of float32)


@dataclass(eq=False)
class Unit:
    name: str
    segments: list[tuple[Tile, int]]  # (tile, element offset in the unit's flat buffer)

    @property
    def numel(self) -> int:
        tile, offset = self.segments[-1]
        return offset + tile.layout.numel

    @property
    def tiles(self) -> list[Tile]:
        return [tile for tile, _ in self.segments]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for tile, offset in self.segments:
            out += tile.layout.views(flat, offset)
        return out

    def padding(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for tile, offset in self.segments:
            out += tile.layout.padding(flat, offset)
        return out

    @staticmethod
    def of(name: str, tiles: list[Tile]) -> "Unit":
        segments, cursor = [], 0
        for tile in tiles:
            segments.append((tile, cursor))
            cursor += tile.layout.numel
        return Unit(name, segments)


class WeightStreamer:
    def __init__(self, device: Device, nbuf: int, numel: int, dtype: torch.dtype, timeline: Timeline):
        self.dev = device
        self.timeline = timeline
        self.nbuf = nbuf
        self.numel = numel
        self.flat = torch.empty(nbuf, numel, dtype=dtype, device=device.torch)  # [slot, element]
        self.slot_unit: list[Unit | None] = [None] * nbuf
        self.slot_versions: list[tuple[int, ...] | None] = [None] * nbuf  # tile versions it holds
        self.ready = [device.event() for _ in range(nbuf)]  # weights-ready, per slot
        self.free = [None] * nbuf  # buffer-free, per slot
        self.current = 0  # slot of the op last acquired
        self.bytes_h2d = 0
        self.staging: torch.Tensor | None = None  # a cast load's chunk on the device (STAGE elements)
        self.wait_s = 0.0  # host time blocked until the optimizer had written a tile to stream
        self.peers = None  # the other ranks' update flags of the shared store (distributed.Flags)

    def start(self, plan: list[Unit]) -> None:
        """Take the units of a step's ops, in order; consecutive uses of one unit share a load."""
        self.loads: list[Unit] = []
        self.load_of: list[int] = []
        for unit in plan:
            if not self.loads or self.loads[-1] is not unit:
                self.loads.append(unit)
            self.load_of.append(len(self.loads) - 1)
        self.issued = 0
        self.op = -1  # the op last acquired

    def acquire(self) -> list[torch.Tensor]:
        """Views of the next op's weights; the compute stream waits for them (the host does not)."""
        self.op += 1
        k = self.load_of[self.op]
        self._issue_through(k)
        self.current = slot = k % self.nbuf
        with self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.WAIT_WEIGHTS):
            self.dev.wait(self.dev.compute, self.ready[slot])
        return self.loads[k].views(self.flat[slot])

    def release(self) -> None:
        """After the op's kernels are issued: free its slot once they run, and prefetch ahead."""
        op = self.op
        k = self.load_of[op]
        if op + 1 < len(self.load_of) and self.load_of[op + 1] == k:
            return  # the next op uses the same load
        self.free[k % self.nbuf] = self.dev.record(self.dev.compute)
        self._issue_through(min(k + self.nbuf - 1, len(self.loads) - 1))

    def current_slot(self, unit: Unit) -> int:
        """The slot of the op last acquired, which must hold `unit`."""
        if self.slot_unit[self.current] is not unit:
            raise RuntimeError(f"{unit.name} is not the unit of the current op")
        return self.current

    def _cast_in(self, into: torch.Tensor, source: torch.Tensor) -> None:
        """A host tensor of another dtype into the device buffer `into`: STAGE elements at a time
        copied as they are into the staging buffer, then cast into place on the device, on the
        current stream (each chunk's cast before the next chunk's copy)."""
        if self.staging is None or self.staging.dtype != source.dtype:
            self.staging = torch.empty(STAGE, dtype=source.dtype, device=into.device)
        for a in range(0, source.numel(), STAGE):
            b = min(source.numel(), a + STAGE)
            part = self.staging[: b - a]
            part.copy_(source[a:b], non_blocking=True)
            into[a:b].copy_(part)

    def wait_updated(self, tiles: list[Tile]) -> None:
        """Block the host until the optimizer has written these tiles' updates (timed); with
        data-parallel ranks, every rank's part of them (`peers`: distributed.Flags)."""
        for tile in tiles:
            if not tile.ready.is_set() or (self.peers is not None and not self.peers.ready(tile.name)):
                start = time.perf_counter()
                with self.timeline.host(Track.HOST, Kind.WAIT_OPTIMIZER, tile.name):
                    tile.ready.wait()
                    if self.peers is not None:
                        self.peers.wait(tile.name)
                self.wait_s += time.perf_counter() - start

    def _issue_through(self, k: int) -> None:
        while self.issued <= k:
            self._issue(self.issued)
            self.issued += 1

    def _issue(self, k: int) -> None:
        unit, slot = self.loads[k], k % self.nbuf
        self.wait_updated(unit.tiles)
        versions = tuple(tile.version for tile in unit.tiles)
        if self.slot_unit[slot] is unit and self.slot_versions[slot] == versions:
            return  # still resident and unchanged (a block's backward right after its recompute)
        stream = self.dev.h2d
        with self.dev.on(stream):
            if self.free[slot] is not None:
                self.dev.wait(stream, self.free[slot])
            with self.timeline.stream(Track.H2D, stream, Kind.LOAD, unit.name):
                for tile, offset in unit.segments:
                    n, source = tile.layout.numel, tile.source
                    into = self.flat[slot, offset: offset + n]
                    if tile.on_device:  # cast on the device, once its update has run
                        if tile.updated is not None:
                            self.dev.wait(stream, tile.updated)
                    else:
                        self.bytes_h2d += n * source.itemsize
                    if tile.on_device or source.dtype == into.dtype or not into.is_cuda:
                        into.copy_(source, non_blocking=True)
                    else:
                        self._cast_in(into, source)
            self.ready[slot] = done = self.dev.record(stream)
        for tile in unit.tiles:
            tile.read_done = done
        self.slot_unit[slot] = unit
        self.slot_versions[slot] = versions


class SlabPool:
    """Pinned float32 host slabs that gradients return into; a slab comes back once the optimizer
    has consumed it, so a slow optimizer holds back the device (back-pressure), never overruns."""

    def __init__(self, count: int, numel: int, pinned: bool, timeline: Timeline):
        self.timeline = timeline
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self.wait_s = 0.0  # host time blocked because every slab was still with the optimizer
        for _ in range(count):
            self._free.put(torch.empty(numel, dtype=torch.float32, pin_memory=pinned))

    def acquire(self) -> torch.Tensor:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        start = time.perf_counter()
        with self.timeline.host(Track.HOST, Kind.WAIT_OPTIMIZER, "slab"):
            slab = self._free.get()
        self.wait_s += time.perf_counter() - start
        return slab

    def release(self, slab: torch.Tensor) -> None:
        self._free.put(slab)
