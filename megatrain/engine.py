"""The engine: the one forward/backward body of a training step, over three streams and events.

The step's ops, in order, come from schedule.py; the engine runs each with one handler per op
kind. A step's micro-batches go through the model together, layer by layer (units in brackets):
  embed      host gathers each micro-batch's embedding rows from the pinned shadow -> H2D
             (a device tile: gathered on the device)
  forward    [layer i] for i = 0..L-1 under no_grad, every micro-batch in turn while the layer's
             weights are resident; the inputs of every K-th layer are kept as checkpoints (on
             the device, or offloaded to pinned host memory: activations.py)
  head       [head] chunked norm + LM head + cross-entropy, forward and backward at once
  blocks     for each block of K layers, last block first, for each micro-batch:
               recompute [layer s..e-1] from the block's checkpoint, building one small
                 autograd graph per layer (its input is a fresh leaf);
               backward [layer e-1..s], each graph released as soon as it has run
  embed      per micro-batch, the input gradient is added by token id into the embedding's
             float32 gradient on the device (for a tied head: into the head's gradient)

Weight gradients sum over the micro-batches in a float32 device buffer per unit, which returns to
pinned host slabs once per step, after the unit's last backward: a gradient crosses the link once
however many micro-batches the step has, and the host keeps no accumulator for it. Each tile's
squared gradient norm is taken there too, on the device, and reaches the optimizer with the step's
end. With K = 1 a layer's recompute and backward of all micro-batches share one weight load.

The last `no_recompute_layers` layers are blocks of their own that the forward already runs with a
graph (the same per-layer graph the recompute builds, kept for every micro-batch until its
backward): no checkpoint and no second forward for them, at the cost of their activations staying
on the device; `auto` takes as many as the memory plan fits (resolve.py). The last
`keep_attention_layers` recomputed layers that can keep their attention's output from the forward
(kept_attention.py) do, per micro-batch, and their recompute runs no attention core; it waits on
the device, or, for the first offloaded_attention_layers of them, in pinned host memory
(activations.py).

Device tiles (store.py) skip the return: their update runs on the compute stream as soon as their
step gradient is complete (with clipping: at the step's end, scaled by the global norm computed
on the device).

A mixture of experts' router loss (moe.py), where the config asks for it, is collected from each
layer's routing in the forward and enters each layer's backward as a second root beside its output.

With data-parallel ranks (distributed.py) the body is the same on every rank, over its rows of
each micro-batch: a unit's step gradient is reduced before it returns (each rank keeps the sum of
its part of every host tile and returns that alone, a device tile's is summed whole), the loss is
normalised by the target tokens of every rank, and the norms are summed over the host's ranks.

Weights saved by the recompute graphs are not kept: a saved-tensor hook records which unit and
offset they came from, and the backward reads them from wherever that unit is resident then.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from megatrain import kept_attention
from megatrain.accumulate import add_into, add_rows, copy_into
from megatrain.activations import Checkpoints, KeptAttention
from megatrain.batch import Batch
from megatrain.buffers import SlabPool, Unit, WeightStreamer
from megatrain.config import EngineSettings, OptimConfig
from megatrain.device import Device
from megatrain.distributed import Comm, Flags, part, slab_numel, slab_pieces
from megatrain.kernels import LOSS, OPTIMIZER
from megatrain.loss import IGNORE, head_loss, head_loss_and_grads, shift_labels
from megatrain.metrics import model_flops
from megatrain.moe import Routing, captured
from megatrain.optim import Optimizer
from megatrain.schedule import (HEAD, Backward, Embed, EmbeddingBackward, EmbeddingGradient, Forward, Head, HeadLoss,
                                PrefetchAttention, PrefetchCheckpoint, Recompute, SaveCheckpoint, Schedule, TakeCheckpoint,
                                evaluation_ops, layers_keeping_attention)
from megatrain.store import HostStore, Tile
from megatrain.templates import Architecture
from megatrain.timeline import Kind, Timeline, Track
from megatrain.unread_mlp import output_unused


class NonFiniteStep(FloatingPointError):
    """A step whose loss or gradient holds a NaN or an infinity: none of it reached the weights."""


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the step's target tokens, plus the router's loss if any (moe.py)
    target_tokens: int
    seq_lengths: list[int]  # non-padding tokens of each sequence (for the FLOPs formula)
    step_time_s: float
    prev_grad_norm: float | None  # of the previous step: this step's is known only once its optimizer runs
    bytes_h2d: int
    bytes_d2h: int
    wait_update_s: float  # host blocked on the optimizer's update of a tile it had to stream
    wait_slab_s: float  # host blocked on a free gradient slab (the optimizer falling behind)
    # per micro-batch: its recompute took the attention of the layers that keep it from the forward
    # (False where it had a mask, or none keeps it)
    attention_kept: list[bool] = field(default_factory=list)


@dataclass
class _Context:
    masks: dict[str, torch.Tensor | None]
    position_ids: torch.Tensor
    position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) by layer type
    attention_kwargs: dict[str, dict]  # what a layer's call adds for its attention, by layer type


@dataclass
class _Step:
    """What one step's ops hand each other, per micro-batch m where it is a list."""
    mbs: list[Batch]
    targets: list[torch.Tensor]
    scale: float  # 1 / the step's target tokens
    hs: list[torch.Tensor] = field(default_factory=list)  # hidden states through the forward
    ctxs: list[_Context] = field(default_factory=list)
    kept: dict[int, list] = field(default_factory=dict)  # layer -> graphs of a layer kept from recompute
    attention_kept: set[int] = field(default_factory=set)  # the micro-batches whose attention was kept
    loss: torch.Tensor | None = None  # summed over target tokens
    correct: torch.Tensor | None = None  # an evaluation's targets that are the logits' argmax
    dhs: list[torch.Tensor] = field(default_factory=list)  # gradients flowing back
    embed_acc: torch.Tensor | None = None  # the embedding's float32 step gradient
    xs: list[torch.Tensor | None] = field(default_factory=list)  # each recompute's input
    graphs: list[list] = field(default_factory=list)  # recomputed graphs awaiting their backward
    accs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> float32 step gradient
    routing: list[Routing] | None = None  # the router's loss to train on (moe.py), per micro-batch


class Engine:
    def __init__(self, arch: Architecture, store: HostStore, device: Device, settings: EngineSettings,
                 optim: OptimConfig, total_steps: int, comm: Comm | None = None, flags: Flags | None = None):
        """`comm`: the data-parallel ranks' collectives (distributed.py; default one rank): this
        rank's CPU optimizer updates its part of each host tile, whose summed gradient the
        reduction brings; `flags`: the other ranks' updates of the shared store, which loads wait for."""
        self.arch, self.shape, self.store, self.dev, self.s = arch, arch.shape, store, device, settings
        self.comm = comm or Comm.single()
        self.dtype = settings.compute
        self.layer_units = [Unit.of(t.name, [t]) for t in store.layers]
        head_tiles = [store.head, store.embed] if self.shape.tied else [store.head]
        self.head_unit = Unit.of(HEAD, head_tiles)
        # the unit whose gradient buffer takes the embedding's rows: the head's when tied
        self.embed_unit = self.head_unit if self.shape.tied else Unit.of("embed", [store.embed])
        self.grad_units = [*self.layer_units, self.head_unit] + ([] if self.shape.tied else [self.embed_unit])
        self.tile_index = {tile: k for k, tile in enumerate(store.tiles)}
        self.sq_host = torch.zeros(len(store.tiles), dtype=torch.float64, pin_memory=device.is_cuda)
        self.norms_host = torch.zeros(len(store.tiles), dtype=torch.float64, pin_memory=device.is_cuda)
        numel = max(u.numel for u in [*self.layer_units, self.head_unit])
        self.timeline = Timeline(device, settings.timeline)
        self.streamer = WeightStreamer(device, settings.weight_buffers, numel, self.dtype, self.timeline)
        pinned = device.is_cuda
        # a slab carries this rank's part of the largest layer's gradient (the whole layer on one
        # rank); bigger tiles (embedding, LM head) return in pieces
        self.slab_numel = slab_numel(max(u.numel for u in self.layer_units), self.comm.ranks.local_world)
        # with clipping each host tile's gradient returns into its own pinned buffer: no slabs
        self.slabs = SlabPool(0 if settings.clipping else max(1, settings.grad_slabs), self.slab_numel, pinned,
                              self.timeline)
        self.sync_grads = settings.grad_slabs == 0
        self.max_tokens = settings.tokens
        self.rows = torch.empty(self.max_tokens * self.shape.hidden, dtype=self.dtype, pin_memory=pinned)
        self.rows_free = device.event()
        host_tiles = [t for t in store.tiles if not t.on_device]
        ranks = self.comm.ranks
        self.parts = {t: part(t.layout.numel, ranks.local_world, ranks.local_rank)[:2] for t in host_tiles}
        self.optimizer = Optimizer(optim, total_steps, device, self.timeline, host_tiles, self.parts,
                                   None if flags is None else (lambda tile: flags.mark(tile.name)),
                                   OPTIMIZER.runs(settings))
        self.streamer.peers = flags
        self.rotary = arch.rotary(device.torch)
        self.checkpoints = Checkpoints(device, self.timeline, settings.offload_checkpoints)
        self.attention = KeptAttention(device, self.timeline, kept_attention.kept_parts(
            self.shape, settings.tokens, self.dtype.itemsize) if settings.offloaded_attention_layers else (0, 0))
        self.bytes_d2h = 0
        self._packing: Unit | None = None
        self._schedules: dict[int, Schedule] = {}
        self._units = {**dict(enumerate(self.layer_units)), HEAD: self.head_unit}
        self._handlers = {
            Embed: self._embed_all, SaveCheckpoint: self._save_checkpoint, Forward: self._forward,
            Head: self._head, HeadLoss: self._head_loss, TakeCheckpoint: self._take_checkpoint,
            PrefetchCheckpoint: self._prefetch_checkpoint, PrefetchAttention: self._prefetch_attention,
            Recompute: self._recompute, Backward: self._backward, EmbeddingBackward: self._embedding_backward,
            EmbeddingGradient: self._embedding_gradient,
        }

    def schedule(self, microbatches: int) -> Schedule:
        """The ops of a step of this many micro-batches."""
        if microbatches not in self._schedules:
            s = self.s
            keep = layers_keeping_attention(self.shape, s.seq_len, s.no_recompute_layers, s.keep_attention_layers)
            self._schedules[microbatches] = Schedule(self.shape.num_layers, s.checkpoint_every, s.no_recompute_layers,
                                                     microbatches, keep, keep[:s.offloaded_attention_layers])
        return self._schedules[microbatches]

    # ------------------------------------------------------------------ the step
    def step(self, microbatches: list[Batch]) -> StepResult:
        start = time.perf_counter()
        targets, n_targets = self._targets(microbatches)  # over every rank: the loss's normaliser
        schedule = self.schedule(len(microbatches))
        self.timeline.begin_step()
        self.optimizer.begin_step(self._contributions())
        before = self._counters()
        step = _Step(microbatches, targets, 1.0 / n_targets)
        s = self.shape
        if s.router_aux_coef:
            step.routing = [Routing(s.experts, s.top_k, s.router_aux_coef / len(microbatches), mb.token_mask())
                            for mb in microbatches]
        with self.dev.on(self.dev.compute):
            self.sq = torch.zeros(len(self.store.tiles), dtype=torch.float64, device=self.dev.torch)
            self._run(schedule.ops, step)
            aux = sum(r.loss() for r in step.routing) if step.routing else 0.0
            self.comm.sum_host(self.sq)  # each rank has the norms of its parts
            self.comm.sum(step.loss)
            self.optimizer.finish_step(self.sq, self.sq_host)
        self.dev.synchronize()  # the step boundary: the only host-device sync of a step
        self.timeline.end_step()
        loss = float(step.loss) / n_targets + float(aux)
        if not math.isfinite(loss) or not bool(torch.isfinite(self.sq_host).all()):
            bad = [t.name for t, v in zip(self.store.tiles, self.sq_host.tolist()) if not math.isfinite(v)]
            raise NonFiniteStep(f"the step's loss is {loss} and its gradient holds a NaN or an infinity in "
                                f"{', '.join(bad) or 'no tile'}: no tile was updated from a non-finite gradient; "
                                f"training stops (the last saved state is as it was)")
        moved = [now - then for now, then in zip(self._counters(), before)]
        lengths = [n for mb in microbatches for n in mb.sequence_lengths()]
        prev = self.optimizer.grad_norms.get(self.optimizer.steps - 2)  # written before this step's forward ended
        return StepResult(loss, n_targets, lengths, time.perf_counter() - start, prev, *moved,
                          [m in step.attention_kept for m in range(len(microbatches))])

    def _targets(self, microbatches: list[Batch]) -> tuple[list[torch.Tensor], int]:
        """Each micro-batch's shifted labels and the step's target tokens; a step the engine cannot
        take is refused before it starts."""
        targets = [shift_labels(mb.labels) for mb in microbatches]
        n_targets = int(self.comm.sum_values(sum(int((t != -100).sum()) for t in targets))[0])
        if n_targets == 0:
            raise ValueError("the step has no target tokens (every label is -100)")
        for mb in microbatches:
            if mb.input_ids.numel() > self.max_tokens:
                raise ValueError(f"a micro-batch has {mb.input_ids.numel()} tokens; the engine was sized "
                                 f"for {self.max_tokens}")
        return targets, n_targets

    def _counters(self) -> tuple[int, int, float, float]:
        """Bytes moved each way and host seconds blocked (on an update, on a slab) so far: StepResult's order."""
        return (self.streamer.bytes_h2d + self.checkpoints.bytes_h2d + self.attention.bytes_h2d,
                self.bytes_d2h + self.checkpoints.bytes_d2h + self.attention.bytes_d2h,
                self.streamer.wait_s, self.slabs.wait_s)

    def evaluate(self, microbatches: list[Batch]) -> tuple[float, int, int]:
        """Summed loss, target tokens and targets predicted (the logits' argmax) of micro-batches,
        forward only: the step's own loop over
        the evaluation's ops (schedule.evaluation_ops), with no gradient or update. Waits for the
        optimizer first, so the weights are those after the last step."""
        self.optimizer.flush()
        targets = [shift_labels(mb.labels) for mb in microbatches]
        step = _Step(microbatches, targets, 1.0)
        self.timeline.begin_step()
        with torch.no_grad(), self.dev.on(self.dev.compute):
            self._run(evaluation_ops(self.shape.num_layers), step)
        self.dev.synchronize()
        self.timeline.end_step()
        return float(step.loss), int(sum(int((t != IGNORE).sum()) for t in targets)), int(step.correct)

    def _run(self, ops, step: _Step) -> None:
        """The one loop: each op's handler, with its weights acquired where it computes."""
        self.streamer.start([self._units[op.loads] for op in ops if op.loads is not None])
        for op in ops:
            label = type(op).__name__ + (f" L{op.layer}" if hasattr(op, "layer") else "")
            with self.timeline.host(Track.ISSUE, Kind.ISSUE, label):
                if op.loads is None:
                    self._handlers[type(op)](step, op, None)
                    continue
                weights = self.streamer.acquire()
                self._handlers[type(op)](step, op, weights)
                self.streamer.release()

    def _contributions(self) -> dict[Tile, int]:
        """How many gradient pieces each tile gets in a step."""
        return {tile: 1 if tile.grad is not None else slab_pieces(self.parts[tile][1] - self.parts[tile][0], self.slab_numel)
                for unit in self.grad_units for tile in unit.tiles if not tile.on_device}

    # ------------------------------------------------------------------ the ops (schedule.py)
    def _embed_all(self, st: _Step, op: Embed, _) -> None:
        st.hs = [self._embed(mb.input_ids) for mb in st.mbs]
        st.ctxs = [self._context(h, mb) for h, mb in zip(st.hs, st.mbs)]

    def _save_checkpoint(self, st: _Step, op: SaveCheckpoint, _) -> None:
        self.checkpoints.put(op.layer, st.hs)

    def _forward(self, st: _Step, op: Forward, w: list[torch.Tensor]) -> None:
        """No graph, except for a layer kept from recompute, whose graph every micro-batch keeps; a
        layer that keeps its attention keeps every micro-batch's attention output where it can."""
        i = op.layer
        with torch.no_grad(), self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.FORWARD, f"L{i}"):
            if op.keep_graph:
                st.kept[i] = [self._graph(i, w, h, ctx) for h, ctx in zip(st.hs, st.ctxs)]
                outs = [(out.detach(), logits) for _, _, out, logits in st.kept[i]]
            elif op.keep_attention:
                outs = []
                for m, (h, ctx) in enumerate(zip(st.hs, st.ctxs)):
                    with kept_attention.keeping() as kept:
                        outs.append(self._layer(i, w, h, ctx))
                    self.attention.put(i, m, kept[0] if kept else None, op.offload_attention)
                    if kept:
                        st.attention_kept.add(m)
            else:
                outs = [self._layer(i, w, h, ctx) for h, ctx in zip(st.hs, st.ctxs)]
            st.hs = [out for out, _ in outs]
            for routing, (_, logits) in zip(st.routing or [], outs):
                if logits is not None:  # a dense layer among sparse ones routes nothing (Qwen3-MoE's mlp_only_layers)
                    routing.add(logits)

    def _head(self, st: _Step, op: Head, w: list[torch.Tensor]) -> None:
        """The loss, its gradient, and the gradient flowing into the last layer."""
        dev, chunk = self.dev, self.s.loss_chunk_tokens
        if st.routing and self.comm.distributed:  # every layer has routed: the whole micro-batches' routing
            for routing in st.routing:
                routing.summed(self.comm.sum)
        with self.timeline.stream(Track.COMPUTE, dev.compute, Kind.HEAD):
            acc = torch.zeros(self.head_unit.numel, dtype=torch.float32, device=dev.torch)
            grads = self.head_unit.views(acc)
            st.loss = torch.zeros((), dtype=torch.float32, device=dev.torch)
            for h, tgt in zip(st.hs, st.targets):
                active = [bool((tgt[lo: lo + chunk] != -100).any()) for lo in range(0, tgt.numel(), chunk)]
                part, dh = head_loss_and_grads(
                    h.reshape(-1, h.shape[-1]), tgt.to(dev.torch, non_blocking=True), active,
                    self.arch.norm_template(), w[0], w[-1], chunk, st.scale, grads[0], grads[-1],
                    compiled=LOSS.runs(self.s), softcap=self.shape.logit_softcap)
                st.loss += part
                st.dhs.append(dh.view(h.shape))
        st.hs = []
        if self.shape.tied:
            st.embed_acc = acc  # the embedding's rows join the head's gradient at the end
        else:
            self._offload(self.head_unit, acc)
            st.embed_acc = torch.zeros(self.embed_unit.numel, dtype=torch.float32, device=dev.torch)
        st.xs = [None] * len(st.mbs)
        st.graphs = [[] for _ in st.mbs]

    def _head_loss(self, st: _Step, op: HeadLoss, w: list[torch.Tensor]) -> None:
        with self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.HEAD):
            parts = [head_loss(h.reshape(-1, h.shape[-1]), t.to(self.dev.torch, non_blocking=True),
                               self.arch.norm_template(), w[0], w[-1], self.s.loss_chunk_tokens,
                               self.shape.logit_softcap)
                     for h, t in zip(st.hs, st.targets)]
            st.loss, st.correct = sum(loss for loss, _ in parts), sum(correct for _, correct in parts)

    def _take_checkpoint(self, st: _Step, op: TakeCheckpoint, _) -> None:
        st.xs = self.checkpoints.take(op.layer)

    def _prefetch_checkpoint(self, st: _Step, op: PrefetchCheckpoint, _) -> None:
        self.checkpoints.prefetch(op.layer)

    def _prefetch_attention(self, st: _Step, op: PrefetchAttention, _) -> None:
        for m in range(len(st.mbs)):
            self.attention.prefetch(op.layer, m)

    def _recompute(self, st: _Step, op: Recompute, w: list[torch.Tensor]) -> None:
        """A small graph for one layer of one micro-batch, from the block's checkpoint or the layer before."""
        m = op.mb
        # the graph holds the kept attention from now on, to its backward
        kept = self.attention.take(op.layer, m) if op.kept_attention else None
        with self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.RECOMPUTE, f"L{op.layer}"), \
                kept_attention.reusing(kept):
            graph = self._graph(op.layer, w, st.xs[m], st.ctxs[m], root_only=op.root_only)
        st.graphs[m].append(graph)
        st.xs[m] = None if op.root_only else graph[2]  # the block's last output is the backward's alone

    def _backward(self, st: _Step, op: Backward, _) -> None:
        """Run one layer's graph (its weights, acquired, are what the unpack hook reads), add its weight
        gradients into the layer's float32 step gradient, and return that after the last micro-batch."""
        i, m = op.layer, op.mb
        if op.recomputed:
            x, leaves, out, logits = st.graphs[m].pop()
        else:
            (x, leaves, out, logits), st.kept[i][m] = st.kept[i][m], None
        unit = self.layer_units[i]
        with self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.BACKWARD, f"L{i}"):
            roots, droots = [out], [st.dhs[m]]
            if st.routing and logits is not None:  # the router's loss through this layer's probabilities
                probs, dprobs = st.routing[m].root(logits)
                roots.append(probs)
                droots.append(dprobs)
            grads = torch.autograd.grad(roots, [x, *leaves], droots)
            st.dhs[m] = grads[0]
            del x, leaves, out, logits, roots
            if op.first:  # the first micro-batch's gradients are copied in, not added to zeros
                st.accs[i] = torch.empty(unit.numel, dtype=torch.float32, device=self.dev.torch)
                for gap in unit.padding(st.accs[i]):
                    gap.zero_()
            into = copy_into if op.first else add_into
            for view, grad in zip(unit.views(st.accs[i]), grads[1:], strict=True):
                into(view, grad)
            del grads
        if op.last:
            self._offload(unit, st.accs.pop(i))

    def _embedding_backward(self, st: _Step, op: EmbeddingBackward, _) -> None:
        with self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.EMBEDDING, "backward"):
            self._embed_backward(st.mbs[op.mb].input_ids, st.dhs[op.mb], st.embed_acc)

    def _embedding_gradient(self, st: _Step, op: EmbeddingGradient, _) -> None:
        self._offload(self.embed_unit, st.embed_acc)

    # ------------------------------------------------------------------ the compute ceiling
    def layer_ceiling(self, batch_size: int, seq_len: int, reps: int = 5, keep_attention: bool = False,
                      index: int = 0) -> dict:
        """Decoder layer `index`'s forward, recompute and backward on one micro-batch of random hidden
        states, its weights resident: the step's own graph (saved-tensor hooks; at K = 1 the recompute
        is a block's last layer's and leaves its unread MLP output out), with nothing streamed during
        it and the host's updates done (their threads would compete with the launching one). The
        rate layer streaming can at best reach. `keep_attention`: the forward keeps the attention's
        output and the recompute reuses it, as a layer that keeps its attention does (where this
        run's layers can: keep_attention_layers > 0)."""
        dev = self.dev
        root_only = self.s.checkpoint_every == 1
        times = []
        with self.ceiling_inputs(batch_size, seq_len, index) as (w, x0, dy, ctx), dev.on(dev.compute):
            for _ in range(reps + 1):
                dev.synchronize()
                start = time.perf_counter()
                keeping = kept_attention.keeping() if keep_attention else contextlib.nullcontext([])
                with torch.no_grad(), keeping as kept:
                    self._layer(index, w, x0, ctx)
                with kept_attention.reusing(kept[0] if kept else None):
                    x, leaves, out, _ = self._graph(index, w, x0, ctx, root_only=root_only)
                torch.autograd.grad(out, [x, *leaves], dy)
                del x, leaves, out
                dev.synchronize()
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        flops = model_flops(self.shape.layer_matmul_params(index), self.shape.attention([index]), [seq_len] * batch_size)
        return {"seconds": seconds, "model_tflops": flops / seconds / 1e12, "tokens": seq_len * batch_size}

    @contextlib.contextmanager
    def ceiling_inputs(self, batch_size: int, seq_len: int, index: int = 0):
        """What a ceiling runs layer `index` on: its weights resident (loaded as a step of its own,
        the host's updates done first), random hidden states and output gradient of one micro-batch
        (seeded), and the micro-batch's context."""
        self.optimizer.flush()
        dev = self.dev
        self.timeline.begin_step()  # its one load is timed as a step of its own (before any step too)
        self.streamer.start([self.layer_units[index]])
        w = self.streamer.acquire()
        try:
            gen = torch.Generator(device=dev.torch).manual_seed(0)
            shape = (batch_size, seq_len, self.shape.hidden)
            x0 = torch.randn(shape, generator=gen, device=dev.torch, dtype=self.dtype)
            dy = torch.randn(shape, generator=gen, device=dev.torch, dtype=self.dtype)
            yield w, x0, dy, self._context(x0, Batch(torch.empty(batch_size, seq_len, dtype=torch.long), None))
        finally:
            self.streamer.release()

    # ------------------------------------------------------------------ pieces
    def _graph(self, index: int, weights: list[torch.Tensor], x: torch.Tensor, ctx: _Context,
               root_only: bool = False):
        """A layer's autograd graph on its own: a fresh leaf as input and fresh leaves as weights,
        whose saved views of the weight buffer the hooks turn into references. `root_only`: the
        output is read by nothing but the backward started from it (a recomputed block's last
        layer), so its MLP need not compute it (unread_mlp.output_unused). Returns the input, the
        weights, the output and the router's logits (None without a router)."""
        leaves = [w.detach().requires_grad_() for w in weights]
        x = x.detach().requires_grad_()
        self._packing = self.layer_units[index]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                (output_unused() if root_only else contextlib.nullcontext()):
            out, logits = self._layer(index, leaves, x, ctx)
        return x, leaves, out, logits

    def _layer(self, index: int, weights: list[torch.Tensor], h: torch.Tensor,
               ctx: _Context) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A layer's output, and its router's logits (None without a router)."""
        module = self.arch.template(index).bind(weights, self.store.buffers[index])
        kind = self.shape.layer_type(index)
        with captured() as logits, self.arch.running():
            out = module(h, attention_mask=ctx.masks[kind], position_ids=ctx.position_ids,
                         position_embeddings=ctx.position_embeddings[kind], **ctx.attention_kwargs[kind])
        return out, (logits[0] if logits else None)

    def _context(self, h: torch.Tensor, mb: Batch) -> _Context:
        """Masks, rotary embeddings and attention kernel options of a micro-batch. Packed rows
        (Batch) come with their position_ids and no mask, from which the library's masks keep their
        examples apart."""
        B, S, _ = h.shape
        if mb.position_ids is not None:
            position_ids = mb.position_ids.to(self.dev.torch, non_blocking=True)
        else:
            position_ids = torch.arange(S, device=self.dev.torch).unsqueeze(0).expand(B, S)
        mask = None
        if mb.attention_mask is not None and not bool(mb.attention_mask.all()):
            mask = mb.attention_mask.to(self.dev.torch, non_blocking=True)
        masks = self.arch.masks(h, mask, position_ids)
        with torch.no_grad():
            position_embeddings = self.arch.position_embeddings(self.rotary, h, position_ids)
        plain = mask is None and mb.position_ids is None
        return _Context(masks, position_ids, position_embeddings, self.arch.attention_kwargs(plain))

    def _embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """Gemma's embedding scale as the library's module applies it: sqrt(hidden) made a float32
        tensor, then cast to the rows' dtype (in bf16 the rounded scale: 59.866 -> 60.0 at 3584); a
        fill on the device, not a copy the host would wait for."""
        return torch.full((), self.shape.embed_scale, dtype=torch.float32, device=self.dev.torch).to(dtype)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The batch's rows of the embedding, times the family's embedding scale where it has one."""
        h = self._embed_rows(ids)
        return h * self._embed_scale(h.dtype) if self.shape.embed_scale else h

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The batch's rows of the embedding: gathered on the host and sent alone, or, for a device
        tile, gathered on the device."""
        tile = self.store.embed
        spec = tile.layout.specs[0]
        if tile.on_device:  # ordered after its update by the compute stream
            table = tile.master[: spec.numel].view(spec.shape)
            return torch.nn.functional.embedding(ids.to(self.dev.torch, non_blocking=True), table).to(self.dtype)
        self.streamer.wait_updated([tile])
        n = ids.numel()
        table = tile.source[: spec.numel].view(spec.shape)
        self.rows_free.synchronize()  # the previous micro-batch's copy out of `rows` is done
        rows = self.rows[: n * self.shape.hidden].view(n, self.shape.hidden)
        with self.timeline.host(Track.HOST, Kind.EMBEDDING, "gather"):
            if table.dtype == rows.dtype:
                torch.index_select(table, 0, ids.reshape(-1), out=rows)
            else:  # a whole master's rows, cast as a load casts them (round to nearest even)
                rows.copy_(table.index_select(0, ids.reshape(-1)))
        h = torch.empty(ids.shape + (self.shape.hidden,), dtype=self.dtype, device=self.dev.torch)
        # h's memory may be a block the compute stream has yet to read (Gemma's scaled rows free the
        # last micro-batch's at once): the copy waits for what the compute stream was given
        allocated = self.dev.record(self.dev.compute)
        with self.dev.on(self.dev.h2d):
            self.dev.wait(self.dev.h2d, allocated)
            h.view(n, -1).copy_(rows, non_blocking=True)
            self.rows_free = ready = self.dev.record(self.dev.h2d)
        self.streamer.bytes_h2d += rows.numel() * rows.itemsize
        self.dev.wait(self.dev.compute, ready)
        return h

    def _embed_backward(self, ids: torch.Tensor, dh: torch.Tensor, acc: torch.Tensor) -> None:
        """Add a micro-batch's input gradient, row by token id, into the embedding's gradient."""
        table = self.embed_unit.views(acc)[-1]  # the embedding (after the final norm when tied)
        ids = ids.reshape(-1).to(self.dev.torch, non_blocking=True)
        dh = dh * self._embed_scale(dh.dtype) if self.shape.embed_scale else dh  # the scale's backward
        rows = dh.reshape(-1, dh.shape[-1]).float()
        if self.shape.padding_idx is not None:  # nn.Embedding(padding_idx=...) gives that row no gradient
            rows.mul_((ids != self.shape.padding_idx).unsqueeze(1))
        add_rows(table, ids, rows)

    def _reducing(self, tile: Tile):
        """The timeline's span of a tile's gradient reduction among the ranks (none with one rank)."""
        if not self.comm.distributed:
            return contextlib.nullcontext()
        return self.timeline.stream(Track.COMPUTE, self.dev.compute, Kind.REDUCE, tile.name)

    def _offload(self, unit: Unit, acc: torch.Tensor) -> None:
        """Return a unit's float32 step gradient to pinned slabs, one piece per slab, or with
        clipping into each host tile's own pinned gradient buffer (a device tile's updates it where
        it is), and add each tile's squared norm into the step's norms.
        With data-parallel ranks a host tile's gradient is first reduced, this rank keeping the
        sum of its part [lo, hi) alone; a device tile's is summed whole (every rank updates its copy,
        the host's first rank counts its norm)."""
        for tile, offset in unit.segments:
            grad = acc[offset: offset + tile.layout.numel]
            k = self.tile_index[tile]
            if tile.on_device:
                with self._reducing(tile):
                    self.comm.sum(grad)
                norm_sq = torch.linalg.vector_norm(grad).double().square()
                if self.comm.ranks.local_rank == 0:
                    self.sq[k] += norm_sq
                self.optimizer.device_gradient(tile, grad, norm_sq)
                continue
            with self._reducing(tile):
                mine, lo, hi = self.comm.reduce_part(grad)
            norm_sq = torch.linalg.vector_norm(mine[: hi - lo]).double().square()
            self.sq[k] += norm_sq
            self._norm_to_host(k, norm_sq)  # of this rank's part: the pieces it applies
            norm_host = self.norms_host[k]
            if tile.grad is not None:  # clipping: this rank's part straight into the tile's pinned buffer
                self._to_host(mine[: hi - lo], tile.grad[lo:hi], tile.name, lambda event: self.optimizer.submit(
                    tile, lo, hi, None, event, lambda: None, norm_host))
                continue
            for a in range(lo, hi, self.slab_numel) if hi > lo else [lo]:  # an empty part: one empty piece
                b = min(hi, a + self.slab_numel)
                slab = self.slabs.acquire()
                host = slab[: b - a]
                release = partial(self.slabs.release, slab)  # bound now: the loop rebinds `slab`
                self._to_host(mine[a - lo: b - lo], host, tile.name, lambda event: self.optimizer.submit(
                    tile, a, b, host, event, release, norm_host))

    def _norm_to_host(self, index: int, norm_sq: torch.Tensor) -> None:
        """A tile's squared gradient norm, on the gradient stream ahead of its pieces: the optimizer
        applies no piece of a gradient that holds a NaN or an infinity, which its norm shows. The
        slot is free again: the tile's next gradient comes after its update, which the next
        forward's load of the tile waits for."""
        stream = self.dev.compute if self.sync_grads else self.dev.d2h
        done = self.dev.record(self.dev.compute)
        with self.dev.on(stream):
            self.dev.wait(stream, done)
            self.norms_host[index].copy_(norm_sq, non_blocking=True)

    def _to_host(self, src: torch.Tensor, dst: torch.Tensor, tile_name: str, submit) -> None:
        """D2H on the gradient stream after the backward-done event; hand the slab to the optimizer."""
        stream = self.dev.compute if self.sync_grads else self.dev.d2h
        backward_done = self.dev.record(self.dev.compute)
        with self.dev.on(stream):
            self.dev.wait(stream, backward_done)
            with self.timeline.stream(Track.D2H, stream, Kind.GRADIENT, tile_name):
                dst.copy_(src, non_blocking=True)
            if self.dev.is_cuda:
                src.record_stream(stream)  # the allocator must not reuse src before the copy ran
            submit(self.dev.record(stream))
        self.bytes_d2h += src.numel() * src.itemsize
        if self.sync_grads:
            self.optimizer.flush()  # ablation: the gradient is consumed before compute goes on

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, t: torch.Tensor):
        flat = self.streamer.flat
        if t.device == flat.device and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            offset = t.storage_offset() % self.streamer.numel
            return (self._packing, offset, t.shape, t.stride())
        return t

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        unit, offset, shape, stride = packed
        slot = self.streamer.current_slot(unit)
        return self.streamer.flat.as_strided(shape, stride, slot * self.streamer.numel + offset)

    def close(self) -> None:
        self.optimizer.flush()
        self.optimizer.close()
        self.attention.close()

