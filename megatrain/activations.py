"""What the forward keeps for the backward, on the device or offloaded to pinned host memory.

Block checkpoints (`Checkpoints`): the input of every K-th layer for each micro-batch, kept for the
backward's recomputation. On the device they grow with depth (one per block). Offloaded, each
returns to pinned host memory on the gradient stream as the forward produces it, and comes back on
the weight stream one block ahead of the backward that needs it: the device then holds two blocks'
checkpoints at most, whatever the depth, for one more crossing of the link per block each way.

Kept attention (`KeptAttention`): the output and log-sum-exp of each micro-batch of the layers that
keep their attention (kept_attention.py), held from the forward to the recompute. A layer's that
the device has no room for (engine.offload_attention) goes the same way: out on the gradient
stream as the forward makes it, back on the weight stream one block ahead of the recompute that
reads it, so the device holds two blocks' of it at most and more layers keep their attention (at
long sequences, where the recompute's attention is most of a layer's time and one layer's kept
attention is gigabytes). The kernel's other outputs (offsets, the dropout seed) are a few scalars
and stay on the device. Its host copies are page-aligned blocks registered with CUDA at their exact
size (store.Blocks), each a micro-batch's largest (`capacity`), not torch's pinned allocator's
powers of two: a 7B layer's 3.56 GiB at a 512K-token sequence would take 4.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megatrain.device import Device
from megatrain.kept_attention import Kept
from megatrain.store import PAGE, Blocks
from megatrain.timeline import Kind, Timeline, Track


class _Offload:
    """The link's two ways for what a forward keeps, by key: out to pinned host copies (made once,
    reused every step) on the gradient stream after the compute that made it, back into fresh
    device tensors on the weight stream, the compute stream waiting for them only when it reads."""

    def __init__(self, device: Device, timeline: Timeline, kind: Kind):
        self.dev, self.timeline, self.kind = device, timeline, kind
        self.host: dict = {}  # key -> pinned copies
        self.ready: dict = {}  # key -> H2D-done event
        self.bytes_h2d = self.bytes_d2h = 0

    def _copies(self, key, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host tensors of `tensors`' shapes and dtypes for `key` (torch's pinned allocator)."""
        host = self.host.get(key)
        if host is None or [t.shape for t in host] != [t.shape for t in tensors]:
            host = self.host[key] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.dev.is_cuda) for t in tensors]
        return host

    def _out(self, key, label: str, tensors: list[torch.Tensor]) -> None:
        host = self._copies(key, tensors)
        done = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.d2h):
            self.dev.wait(self.dev.d2h, done)
            with self.timeline.stream(Track.D2H, self.dev.d2h, self.kind, label):
                for t, dst in zip(tensors, host):
                    dst.copy_(t, non_blocking=True)
                    if self.dev.is_cuda:
                        t.record_stream(self.dev.d2h)
        self.bytes_d2h += sum(t.numel() * t.itemsize for t in tensors)

    def _back(self, key, label: str) -> list[torch.Tensor]:
        host = self.host[key]
        dst = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.dev.torch) for t in host]
        allocated = self.dev.record(self.dev.compute)  # the memory's previous user has run
        with self.dev.on(self.dev.h2d):
            self.dev.wait(self.dev.h2d, allocated)
            with self.timeline.stream(Track.H2D, self.dev.h2d, self.kind, label):
                for t, d in zip(host, dst):
                    d.copy_(t, non_blocking=True)
            self.ready[key] = self.dev.record(self.dev.h2d)
        self.bytes_h2d += sum(t.numel() * t.itemsize for t in host)
        return dst

    def _arrived(self, key) -> None:
        if key in self.ready:
            self.dev.wait(self.dev.compute, self.ready.pop(key))


class Checkpoints(_Offload):
    def __init__(self, device: Device, timeline: Timeline, offload: bool):
        super().__init__(device, timeline, Kind.CHECKPOINT)
        self.offload = offload
        self.kept: dict[int, list[torch.Tensor]] = {}  # block start -> device tensors (or in flight)

    def put(self, start: int, hs: list[torch.Tensor]) -> None:
        """Keep the inputs of the block starting at layer `start` (after the forward issued them)."""
        if self.offload:
            self._out(start, f"L{start}", hs)
        else:
            self.kept[start] = hs

    def prefetch(self, start: int) -> None:
        """Start bringing the block's checkpoints back (no-op when they stayed on the device)."""
        if self.offload and start not in self.kept:
            self.kept[start] = self._back(start, f"L{start}")

    def take(self, start: int) -> list[torch.Tensor]:
        """The block's checkpoints on the device; the compute stream waits for their copy."""
        self.prefetch(start)
        self._arrived(start)
        return self.kept.pop(start)


class KeptAttention(_Offload):
    """Each (layer, micro-batch)'s kept attention from its forward to its recompute: as it is, or
    its output and log-sum-exp in pinned host memory between the two (`put`'s `offload`)."""

    def __init__(self, device: Device, timeline: Timeline, capacity: tuple[int, int] = (0, 0)):
        """`capacity`: the bytes of a micro-batch's largest output and log-sum-exp."""
        super().__init__(device, timeline, Kind.CHECKPOINT)
        # (layer, mb) -> the forward's; offloaded, without its output and log-sum-exp until they are back
        self.kept: dict[tuple[int, int], Kept | None] = {}
        self.capacity = capacity
        self.blocks = Blocks(register=True)
        self.block: dict[tuple[int, int], torch.Tensor] = {}  # (layer, mb) -> its host block, made once

    def _copies(self, key, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The output and log-sum-exp's host copies: views at the front of each of the key's block's
        two page-aligned parts."""
        out, lse = tensors
        if any(t.numel() * t.itemsize > cap for t, cap in zip(tensors, self.capacity)):
            raise ValueError(f"kept attention of {out.numel() * out.itemsize} + {lse.numel() * lse.itemsize} bytes "
                             f"past the {self.capacity} the plan made room for")
        first = -(-self.capacity[0] // PAGE) * PAGE
        if key not in self.block:
            self.block[key] = self.blocks(first + self.capacity[1], self.dev.is_cuda)
        block = self.block[key]
        # in the layout the kernel gave (dense, maybe permuted: flash attention's output), which the
        # copy back keeps for the kernel's backward
        self.host[key] = [block[start: start + t.numel() * t.itemsize].view(t.dtype).as_strided(t.shape, t.stride())
                          for start, t in ((0, out), (first, lse))]
        return self.host[key]

    def close(self) -> None:
        """Unregister the host blocks (no copy reads them after the last step)."""
        self.blocks.close()
        self.block.clear()

    def put(self, layer: int, mb: int, kept: Kept | None, offload: bool) -> None:
        """Keep a layer's attention of one micro-batch (after the forward issued it; None: it kept
        none), on the device or, `offload`, its large tensors in host memory."""
        if offload and kept is not None:
            self._out((layer, mb), f"A{layer}.{mb}", [kept.out, kept.state[0]])
            kept = replace(kept, out=None, state=(None, *kept.state[1:]))
        self.kept[layer, mb] = kept

    def prefetch(self, layer: int, mb: int) -> None:
        """Start bringing a layer's attention of one micro-batch back (no-op where it stayed on the device)."""
        kept = self.kept.get((layer, mb))
        if kept is not None and kept.out is None:
            out, lse = self._back((layer, mb), f"A{layer}.{mb}")
            self.kept[layer, mb] = replace(kept, out=out, state=(lse, *kept.state[1:]))

    def take(self, layer: int, mb: int) -> Kept | None:
        """The layer's attention of one micro-batch on the device (None: it kept none); the compute
        stream waits for its copy."""
        self.prefetch(layer, mb)
        self._arrived((layer, mb))
        return self.kept.pop((layer, mb))
