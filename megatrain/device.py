"""The compute device and its three streams, ordered only by events.

On CUDA: a compute stream, a weight (H2D) stream and a gradient (D2H) stream. On the CPU the same
calls are no-ops (work is synchronous), so the engine runs one code path everywhere.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch


class _NoEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def grow_expandable_segments() -> None:
    """Let the CUDA allocator grow expandable segments (a large block then fits wherever the cache has
    the room, not only in one free piece), unless the user's PYTORCH_CUDA_ALLOC_CONF sets the
    allocator: theirs wins."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        with warnings.catch_warnings():  # torch 2.11 names a newer private twin of this call
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def held_by_others(index: int) -> str:
    """`: other processes hold N GiB of it`, as the driver (NVML) counts it, or nothing where it cannot say."""
    try:
        used = torch.cuda.device_memory_used(index)
    except Exception:  # NVML absent, or the driver refusing this too: the message stands without numbers
        return ""
    return f": other processes hold {used / 2**30:.1f} GiB of it (nvidia-smi lists them)"


class Device:
    def __init__(self, name: str = "auto"):
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        self.torch = torch.device(name)
        self.is_cuda = self.torch.type == "cuda"
        if self.is_cuda and not torch.cuda.is_available():
            raise ValueError(f"engine.device is {name!r} but CUDA is not available here")
        if self.torch.type not in ("cuda", "cpu"):
            raise ValueError(f"engine.device must be cpu or cuda[:N], not {name!r}")
        if self.is_cuda:
            if self.torch.index is None:
                self.torch = torch.device("cuda", torch.cuda.current_device())
            try:
                torch.cuda.set_device(self.torch)  # creates the CUDA context: a few hundred MiB
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                raise ValueError(f"engine.device {self.torch}: no room for a CUDA context, the device is out "
                                 f"of memory before the run began{held_by_others(self.torch.index)}") from None
            grow_expandable_segments()
            self.compute = torch.cuda.Stream(self.torch)
            self.h2d = torch.cuda.Stream(self.torch)
            self.d2h = torch.cuda.Stream(self.torch)
        else:
            self.compute = self.h2d = self.d2h = None

    def event(self):
        return torch.cuda.Event() if self.is_cuda else _NoEvent()

    def record(self, stream) -> object:
        """An event marking everything issued so far on `stream`."""
        event = self.event()
        if self.is_cuda:
            event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        """Make `stream` wait for `event` on the device; the host does not block."""
        if self.is_cuda:
            stream.wait_event(event)

    def on(self, stream):
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch)

    def free_bytes(self) -> int | None:
        """What a new run on this device can allocate: the driver's free memory and the blocks this
        process's allocator holds cached but unused (an earlier run's, closed: reused, not lost)."""
        if not self.is_cuda:
            return None
        cached = torch.cuda.memory_reserved(self.torch) - torch.cuda.memory_allocated(self.torch)
        return torch.cuda.mem_get_info(self.torch)[0] + cached
