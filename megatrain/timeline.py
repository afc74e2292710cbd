"""A per-step record of where time goes: spans on the compute, weight (H2D) and gradient (D2H)
streams, the main thread's issuing of each op and its blocking waits, and the CPU optimizer's tasks.

Stream spans are timed by CUDA events; on the CPU, where every op runs synchronously on the host,
by the host clock. Host spans use the host clock; the two clocks are aligned at the start of the
step, when the device is idle. Every span has a Track (where it ran) and a Kind (what it was), so
nothing downstream reads meaning out of a label. After the step boundary `spans()` gives them in
seconds from the step's start, and `summary()` the exposed-time breakdown:

  gpu_busy_frac      compute-stream time in ops / step time (the gradients' reduction among
                     data-parallel ranks included: the collective the compute stream waits for)
  reduce_s           of which the gradients' reduction (`Kind.REDUCE`)
  wait_weights_s     compute stream stalled on its weights-ready event
  optimizer_exposed_s  compute stream idle while the host was blocked on the optimizer (a tile's
                     update or a free gradient slab): the part of the optimizer that is not hidden
  idle_unattributed_s  compute stream idle with no wait on weights or the optimizer recorded: the
                     host behind in issuing work (its own work between ops, kernel launches, a
                     sync), or a wait the timeline does not record
  idle_while_issuing_s  the part of it during which the main thread was inside an op's issuing and
                     not in a recorded wait: the launches fell behind the GPU, or the thread could
                     not run (another thread holding the GIL did this, docs/decisions.md, "The host AdamW")
  layer_s.L<i>       decoder layer i's forward, recompute and backward spans on the compute stream,
                     every micro-batch's (against its single-layer ceiling: suite/worker.py)
"""
from __future__ import annotations

import contextlib
import threading
import time
from enum import StrEnum
from typing import NamedTuple

import torch


class Track(StrEnum):
    COMPUTE = "compute"  # the compute stream
    H2D = "h2d"  # the weight stream (and checkpoints coming back)
    D2H = "d2h"  # the gradient stream (and checkpoints going out)
    HOST = "host"  # the main thread's host work and blocking waits
    ISSUE = "issue"  # the main thread issuing each op's work (its waits inside are on HOST too)
    OPTIMIZER = "optimizer"  # the CPU optimizer's thread


class Kind(StrEnum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    HEAD = "head"
    EMBEDDING = "embedding"  # the embedding's gather and its backward
    LOAD = "load"  # a unit's weights to the device
    # what the forward keeps for the backward leaving or coming back: a block's checkpoints (label
    # L<start>), a layer's kept attention of one micro-batch (A<layer>.<mb>; offload_attention)
    CHECKPOINT = "checkpoint"
    GRADIENT = "gradient"  # a step gradient to a host slab
    REDUCE = "reduce"  # a step gradient summed over the data-parallel ranks (the compute stream waits for it)
    UPDATE = "update"  # an AdamW update (host tiles on the optimizer thread, device tiles on compute)
    WAIT_WEIGHTS = "wait weights"  # compute stalled until its weights arrived
    WAIT_OPTIMIZER = "wait optimizer"  # the host blocked on the optimizer (a tile's update, a slab)
    OPTIMIZER_STEP = "optimizer step"  # the optimizer thread's step begin and finish
    ISSUE = "issue"  # one op of the schedule, issued by the main thread


class Span(NamedTuple):
    track: Track
    kind: Kind
    label: str  # which layer, tile or range
    start_s: float
    end_s: float

    @property
    def name(self) -> str:
        return f"{self.kind} {self.label}".rstrip()


class Timeline:
    def __init__(self, device, enabled: bool):
        self.dev = device
        self.enabled = enabled
        self._lock = threading.Lock()
        self._open: list = []
        self._step_end: float | None = None  # host seconds from the step's start, once it ended

    def begin_step(self) -> None:
        if not self.enabled:
            return
        with self._lock:  # the optimizer's thread adds spans meanwhile: each goes to one step whole
            self._open = []  # (track, kind, label, start, end): events on CUDA, host seconds otherwise
            self._host0 = time.perf_counter()
            self._step_end = None
        if self.dev.is_cuda:
            self._event0 = self._event(self.dev.compute)

    def end_step(self) -> None:
        """After the step boundary's synchronize."""
        if self.enabled:
            self._step_end = time.perf_counter() - self._host0

    @contextlib.contextmanager
    def stream(self, track: Track, stream, kind: Kind, label: str = ""):
        """A span of the work issued on `stream` inside the block."""
        if not self.enabled:
            yield
            return
        if not self.dev.is_cuda:
            with self.host(track, kind, label):
                yield
            return
        start = self._event(stream)
        yield
        self._add(track, kind, label, start, self._event(stream))

    @contextlib.contextmanager
    def host(self, track: Track, kind: Kind, label: str = ""):
        """A span of host time inside the block (any thread)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        with self._lock:  # this step's origin, read with the list the span joins
            self._open.append((track, kind, label, start - self._host0, end - self._host0))

    def spans(self, cut: bool = True) -> list[Span]:
        """The step's spans from its start. The optimizer's thread works across step boundaries (the
        last step's update beside this step's forward, this step's after its end): `cut`, only
        their parts within the step (what the step's summary counts); else as they ran (a trace)."""
        with self._lock:
            rows = list(self._open)
        out = []
        for track, kind, label, start, end in rows:
            if not isinstance(start, float):  # CUDA events, complete after the step's synchronize
                start = self._event0.elapsed_time(start) / 1e3
                end = self._event0.elapsed_time(end) / 1e3
            start = max(start, 0.0)
            if cut and self._step_end is not None:
                end = min(end, self._step_end)
            if end > 0.0 and end >= start:  # a span wholly after the step's end has no part in it
                out.append(Span(track, kind, label, start, end))
        return sorted(out, key=lambda s: s.start_s)

    def summary(self) -> dict[str, float]:
        spans = self.spans()
        step = self._step_end if self._step_end is not None else max([0.0] + [s.end_s for s in spans])
        busy = _union([(s.start_s, s.end_s) for s in spans if s.track == Track.COMPUTE and s.kind != Kind.WAIT_WEIGHTS])
        blocked = _union([(s.start_s, s.end_s) for s in spans if s.kind == Kind.WAIT_OPTIMIZER])
        idle = _complement(busy, 0.0, step)
        waits = _union([(s.start_s, s.end_s) for s in spans if s.kind in (Kind.WAIT_WEIGHTS, Kind.WAIT_OPTIMIZER)])
        issuing = _union([(s.start_s, s.end_s) for s in spans if s.track == Track.ISSUE])

        def total(track: Track, kind: Kind | None = None) -> float:
            return sum(s.end_s - s.start_s for s in spans if s.track == track and kind in (None, s.kind))
        layers: dict[str, float] = {}
        for s in spans:
            if s.track == Track.COMPUTE and s.kind in (Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD):
                layers[s.label] = layers.get(s.label, 0.0) + s.end_s - s.start_s
        return {
            "step_s": step,
            "gpu_busy_s": _length(busy),
            "gpu_busy_frac": _length(busy) / step if step else 0.0,
            "reduce_s": total(Track.COMPUTE, Kind.REDUCE),
            "wait_weights_s": total(Track.COMPUTE, Kind.WAIT_WEIGHTS),
            "optimizer_exposed_s": _length(_intersect(idle, blocked)),
            "host_blocked_on_optimizer_s": _length(blocked),
            "idle_unattributed_s": _length(_intersect(idle, _complement(waits, 0.0, step))),
            "idle_while_issuing_s": _length(_intersect(_intersect(idle, _complement(waits, 0.0, step)), issuing)),
            "h2d_busy_s": total(Track.H2D),
            "d2h_busy_s": total(Track.D2H),
            "optimizer_busy_s": total(Track.OPTIMIZER),
            **{f"layer_s.{label}": seconds for label, seconds in layers.items()},
        }

    def chrome_trace(self) -> dict:
        """The step as a Chrome trace (opens in Perfetto / chrome://tracing): one thread per track,
        each span's kind as its category, the optimizer's updates running past the step's end whole."""
        tracks = list(Track)
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": str(t)}}
                  for i, t in enumerate(tracks)]
        for span in self.spans(cut=False):
            events.append({"name": span.name, "cat": str(span.kind), "ph": "X", "pid": 0,
                           "tid": tracks.index(span.track), "ts": span.start_s * 1e6,
                           "dur": max(0.0, span.end_s - span.start_s) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _event(self, stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _add(self, track: Track, kind: Kind, label: str, start, end) -> None:
        with self._lock:
            self._open.append((track, kind, label, start, end))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _complement(union: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, cursor = [], lo
    for s, e in union:
        if s > cursor:
            out.append((cursor, min(s, hi)))
        cursor = max(cursor, e)
    if cursor < hi:
        out.append((cursor, hi))
    return out


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)
