"""The schedule: the one forward/backward body of a training step, over three streams and events.

A step's micro-batches go through the model together, layer by layer (units in brackets):
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
on the device; the memory plan says how many fit (memory.choose_no_recompute).

Device tiles (store.py) skip the return: their update runs on the compute stream as soon as their
step gradient is complete (with clipping: at the step's end, scaled by the global norm computed
on the device).

Weights saved by the recompute graphs are not kept: a saved-tensor hook records which unit and
offset they came from, and the backward reads them from wherever that unit is resident then.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial

import torch

from megatrain.activations import Checkpoints
from megatrain.arch import Architecture
from megatrain.buffers import SlabPool, Unit, WeightStreamer
from megatrain.config import EngineConfig, OptimConfig
from megatrain.device import Device
from megatrain.loss import head_loss_and_grads, shift_labels
from megatrain.optim import OptimizerWorker, adamw, lr_at
from megatrain.store import HostStore, Layout, Tile
from megatrain.timeline import COMPUTE, D2H, HOST, Timeline
from megatrain.unread_mlp import output_unused


@dataclass
class Batch:
    """One micro-batch on the host: token ids and labels [B, S] (-100: no loss), optional mask [B, S]."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the step's target tokens
    target_tokens: int
    seq_lengths: list[int]  # non-padding tokens of each sequence (for the FLOPs formula)
    step_time_s: float
    prev_grad_norm: float | None  # of the previous step: this step's is known only once its optimizer runs
    bytes_h2d: int
    bytes_d2h: int
    wait_update_s: float  # host blocked on the optimizer's update of a tile it had to stream
    wait_slab_s: float  # host blocked on a free gradient slab (the optimizer falling behind)


@dataclass
class _Context:
    masks: dict[str, torch.Tensor | None]
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]


class Engine:
    def __init__(self, arch: Architecture, store: HostStore, device: Device, cfg: EngineConfig,
                 optim: OptimConfig, total_steps: int, compute_dtype: torch.dtype, max_tokens: int):
        self.arch, self.store, self.dev, self.cfg = arch, store, device, cfg
        self.dtype = compute_dtype
        self.layer_units = [Unit.of(t.name, [t]) for t in store.layers]
        head_tiles = [store.head, store.embed] if arch.tied else [store.head]
        self.head_unit = Unit.of("head", head_tiles)
        # the unit whose gradient buffer takes the embedding's rows: the head's when tied
        self.embed_unit = self.head_unit if arch.tied else Unit.of("embed", [store.embed])
        self.grad_units = [*self.layer_units, self.head_unit] + ([] if arch.tied else [self.embed_unit])
        self.tile_index = {tile: k for k, tile in enumerate(store.tiles)}
        self.sq_host = torch.zeros(len(store.tiles), dtype=torch.float64, pin_memory=device.is_cuda)
        L, K = arch.num_layers, cfg.checkpoint_every
        # layers from `kept` on keep their forward graph: each is a block of its own, not recomputed
        self.kept = L - cfg.no_recompute_layers
        self.blocks = [(s, min(s + K, self.kept)) for s in range(0, self.kept, K)] + [(i, i + 1) for i in range(self.kept, L)]
        numel = max(u.numel for u in [*self.layer_units, self.head_unit])
        self.timeline = Timeline(device, cfg.timeline)
        self.streamer = WeightStreamer(device, cfg.weight_buffers, numel, compute_dtype, self.timeline)
        pinned = device.is_cuda
        # a slab carries a layer's gradient; bigger tiles (embedding, LM head) return in pieces
        self.slab_numel = Layout.of(arch.layer_specs).numel
        self.slabs = SlabPool(max(1, cfg.grad_slabs), self.slab_numel, pinned, self.timeline)
        self.sync_grads = cfg.grad_slabs == 0
        self.rows = torch.empty(max_tokens * arch.hidden, dtype=compute_dtype, pin_memory=pinned)
        self.rows_free = device.event()
        self.max_tokens = max_tokens
        self.worker = OptimizerWorker([t for t in store.tiles if not t.on_device], optim, total_steps,
                                      self.timeline)
        self._clip_later: list[tuple[Tile, torch.Tensor]] = []  # device tiles' gradients awaiting the norm
        self.rotary = arch.rotary(device.torch)
        self.checkpoints = Checkpoints(device, self.timeline, cfg.offload_checkpoints)
        self.bytes_d2h = 0
        self._packing: Unit | None = None

    # ------------------------------------------------------------------ the step
    def step(self, microbatches: list[Batch]) -> StepResult:
        start = time.perf_counter()
        targets = [shift_labels(mb.labels) for mb in microbatches]
        n_targets = int(sum(int((t != -100).sum()) for t in targets))
        if n_targets == 0:
            raise ValueError("the step has no target tokens (every label is -100)")
        for mb in microbatches:
            if mb.input_ids.numel() > self.max_tokens:
                raise ValueError(f"a micro-batch has {mb.input_ids.numel()} tokens; the engine was sized "
                                 f"for {self.max_tokens}")
        M = len(microbatches)
        self.timeline.begin_step()
        self.worker.begin_step(self._contributions())
        plan = self.layer_units + [self.head_unit]
        for s, e in reversed(self.blocks):
            recompute = self.layer_units[s:e] if s < self.kept else []
            plan += (recompute + self.layer_units[s:e][::-1]) * M
        self.streamer.start(plan)
        h2d0 = self.streamer.bytes_h2d + self.checkpoints.bytes_h2d
        d2h0 = self.bytes_d2h + self.checkpoints.bytes_d2h
        wait_update0, wait_slab0 = self.streamer.wait_s, self.slabs.wait_s
        with self.dev.on(self.dev.compute):
            self.sq = torch.zeros(len(self.store.tiles), dtype=torch.float64, device=self.dev.torch)
            loss = self._run(microbatches, targets, 1.0 / n_targets)
            if self._clip_later:
                self._clip_and_update_device_tiles()
            self.sq_host.copy_(self.sq, non_blocking=True)
            self.worker.finish_step(self.sq_host, self.dev.record(self.dev.compute))
        self.dev.synchronize()  # the step boundary: the only host-device sync of a step
        self.timeline.end_step()
        loss_value = float(loss) / n_targets
        lengths = []
        for mb in microbatches:
            mask = mb.attention_mask if mb.attention_mask is not None else torch.ones_like(mb.input_ids)
            lengths += [int(n) for n in mask.sum(dim=1)]
        prev = self.worker.grad_norms.get(self.worker.steps_begun - 2)  # written before this step's forward ended
        return StepResult(loss_value, n_targets, lengths, time.perf_counter() - start, prev,
                          self.streamer.bytes_h2d + self.checkpoints.bytes_h2d - h2d0,
                          self.bytes_d2h + self.checkpoints.bytes_d2h - d2h0,
                          self.streamer.wait_s - wait_update0, self.slabs.wait_s - wait_slab0)

    def _contributions(self) -> dict[Tile, int]:
        """How many gradient pieces each tile gets in a step."""
        return {tile: -(-tile.layout.numel // self.slab_numel)
                for unit in self.grad_units for tile in unit.tiles if not tile.on_device}

    def _run(self, mbs: list[Batch], targets: list[torch.Tensor], scale: float) -> torch.Tensor:
        dev, stream, tl, K = self.dev, self.streamer, self.timeline, self.cfg.checkpoint_every
        hs = [self._embed(mb.input_ids) for mb in mbs]
        ctxs = [self._context(h, mb.attention_mask) for h, mb in zip(hs, mbs)]
        # forward: no graph, keeping the inputs of every recomputed block; the layers not
        # recomputed keep their graphs instead, every micro-batch's
        checkpoints = self.checkpoints
        kept: dict[int, list] = {}
        with torch.no_grad():
            for i in range(self.arch.num_layers):
                if i < self.kept and i % K == 0:
                    checkpoints.put(i, hs)
                w = stream.acquire()
                with tl.stream(COMPUTE, dev.compute, f"forward L{i}"):
                    if i < self.kept:
                        hs = [self._layer(i, w, h, ctx) for h, ctx in zip(hs, ctxs)]
                    else:
                        kept[i] = [self._graph(i, w, h, ctx) for h, ctx in zip(hs, ctxs)]
                        hs = [out.detach() for _, _, out in kept[i]]
                stream.release()
        # head: loss, its gradient, and the gradient flowing into the last layer
        w = stream.acquire()
        chunk = self.cfg.loss_chunk_tokens
        dhs = []
        with tl.stream(COMPUTE, dev.compute, "head"):
            acc = torch.zeros(self.head_unit.numel, dtype=torch.float32, device=dev.torch)
            grads = self.head_unit.views(acc)
            loss = torch.zeros((), dtype=torch.float32, device=dev.torch)
            for h, tgt in zip(hs, targets):
                active = [bool((tgt[lo: lo + chunk] != -100).any()) for lo in range(0, tgt.numel(), chunk)]
                part, dh = head_loss_and_grads(
                    h.reshape(-1, h.shape[-1]), tgt.to(dev.torch, non_blocking=True), active,
                    self.arch.norm_template(), w[0], w[-1], chunk, scale, grads[0], grads[-1])
                loss += part
                dhs.append(dh.view(h.shape))
        del hs
        if self.arch.tied:
            embed_acc = acc  # the embedding's rows join the head's gradient at the end
        else:
            self._offload(self.head_unit, acc)
            embed_acc = torch.zeros(self.embed_unit.numel, dtype=torch.float32, device=dev.torch)
        del acc, grads
        stream.release()
        # blocks in reverse; per micro-batch: recompute with small graphs (or take the kept one),
        # backward layer by layer
        for b in reversed(range(len(self.blocks))):
            s, e = self.blocks[b]
            recompute = s < self.kept
            inputs = checkpoints.take(s) if recompute else [None] * len(mbs)
            if b > 0 and self.blocks[b - 1][0] < self.kept:
                checkpoints.prefetch(self.blocks[b - 1][0])  # overlaps this block's compute
            accs = {}
            for m, (x, ctx) in enumerate(zip(inputs, ctxs)):
                if recompute:
                    graphs = []
                    for i in range(s, e):
                        w = stream.acquire()
                        with tl.stream(COMPUTE, dev.compute, f"recompute L{i}"):
                            graphs.append(self._graph(i, w, x, ctx, root_only=i == e - 1))
                        x = graphs[-1][2]
                        stream.release()
                else:
                    graphs, kept[s][m] = [kept[s][m]], None
                dh = dhs[m]
                for i in reversed(range(s, e)):
                    stream.acquire()  # the weights the unpack hook will read
                    x, leaves, out = graphs.pop()
                    unit = self.layer_units[i]
                    with tl.stream(COMPUTE, dev.compute, f"backward L{i}"):
                        grads = torch.autograd.grad(out, [x, *leaves], dh)
                        dh = grads[0]
                        del x, leaves, out
                        if m == 0:
                            accs[i] = torch.zeros(unit.numel, dtype=torch.float32, device=dev.torch)
                        for view, grad in zip(unit.views(accs[i]), grads[1:], strict=True):
                            view.add_(grad)
                        del grads
                    if m == len(mbs) - 1:
                        self._offload(unit, accs.pop(i))
                    stream.release()
                dhs[m] = dh
                inputs[m] = None  # this micro-batch's checkpoint is done with
                if s == 0:
                    with tl.stream(COMPUTE, dev.compute, "embedding backward"):
                        self._embed_backward(mbs[m].input_ids, dh, embed_acc)
        self._offload(self.embed_unit, embed_acc)
        return loss

    # ------------------------------------------------------------------ pieces
    def _graph(self, index: int, weights: list[torch.Tensor], x: torch.Tensor, ctx: _Context,
               root_only: bool = False):
        """A layer's autograd graph on its own: a fresh leaf as input and fresh leaves as weights,
        whose saved views of the weight buffer the hooks turn into references. `root_only`: the
        output is read by nothing but the backward started from it (a recomputed block's last
        layer), so its MLP need not compute it (unread_mlp.output_unused)."""
        leaves = [w.detach().requires_grad_() for w in weights]
        x = x.detach().requires_grad_()
        self._packing = self.layer_units[index]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                (output_unused() if root_only else contextlib.nullcontext()):
            out = self._layer(index, leaves, x, ctx)
        return x, leaves, out

    def _layer(self, index: int, weights: list[torch.Tensor], h: torch.Tensor, ctx: _Context) -> torch.Tensor:
        module = self.arch.template(index).bind(weights)
        return module(h, attention_mask=ctx.masks[self.arch.layer_type(index)],
                      position_ids=ctx.position_ids, position_embeddings=ctx.position_embeddings)

    def _context(self, h: torch.Tensor, attention_mask: torch.Tensor | None) -> _Context:
        B, S, _ = h.shape
        position_ids = torch.arange(S, device=self.dev.torch).unsqueeze(0).expand(B, S)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.to(self.dev.torch, non_blocking=True)
        masks = self.arch.masks(h, mask, position_ids)
        with torch.no_grad():
            cos, sin = self.rotary(h, position_ids)
        return _Context(masks, position_ids, (cos, sin))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The batch's rows of the embedding: gathered on the host and sent alone, or, for a device
        tile, gathered on the device."""
        tile = self.store.embed
        spec = tile.layout.specs[0]
        if tile.on_device:  # ordered after its update by the compute stream
            table = tile.master[: spec.numel].view(spec.shape)
            return torch.nn.functional.embedding(ids.to(self.dev.torch, non_blocking=True), table).to(self.dtype)
        self.streamer.wait_updated([tile])
        n = ids.numel()
        table = tile.shadow[: spec.numel].view(spec.shape)
        self.rows_free.synchronize()  # the previous micro-batch's copy out of `rows` is done
        rows = self.rows[: n * self.arch.hidden].view(n, self.arch.hidden)
        with self.timeline.host(HOST, "embedding gather"):
            torch.index_select(table, 0, ids.reshape(-1), out=rows)
        h = torch.empty(ids.shape + (self.arch.hidden,), dtype=self.dtype, device=self.dev.torch)
        with self.dev.on(self.dev.h2d):
            h.view(n, -1).copy_(rows, non_blocking=True)
            self.rows_free = ready = self.dev.record(self.dev.h2d)
        self.streamer.bytes_h2d += rows.numel() * rows.itemsize
        self.dev.wait(self.dev.compute, ready)
        return h

    def _embed_backward(self, ids: torch.Tensor, dh: torch.Tensor, acc: torch.Tensor) -> None:
        """Add a micro-batch's input gradient, row by token id, into the embedding's gradient."""
        table = self.embed_unit.views(acc)[-1]  # the embedding (after the final norm when tied)
        ids = ids.reshape(-1).to(self.dev.torch, non_blocking=True)
        rows = dh.reshape(-1, dh.shape[-1]).float()
        if self.arch.padding_idx is not None:  # nn.Embedding(padding_idx=...) gives that row no gradient
            rows.mul_((ids != self.arch.padding_idx).unsqueeze(1))
        table.index_add_(0, ids, rows)

    def _offload(self, unit: Unit, acc: torch.Tensor) -> None:
        """Return a unit's float32 step gradient to pinned slabs, one piece per slab (a device
        tile's updates it where it is), and add each tile's squared norm into the step's norms."""
        for tile, offset in unit.segments:
            grad = acc[offset: offset + tile.layout.numel]
            self.sq[self.tile_index[tile]] += torch.linalg.vector_norm(grad).double().square()
            if tile.on_device:
                if self.worker.cfg.max_grad_norm is None:
                    self._update_device_tile(tile, grad)
                else:
                    self._clip_later.append((tile, grad))
                continue
            for lo in range(0, tile.layout.numel, self.slab_numel):
                hi = min(tile.layout.numel, lo + self.slab_numel)
                slab = self.slabs.acquire()
                host = slab[: hi - lo]
                release = partial(self.slabs.release, slab)  # bound now: the loop rebinds `slab`
                self._to_host(grad[lo:hi], host, f"gradient {tile.name}", lambda event: self.worker.submit_dense(
                    tile, lo, hi, host, event, release))

    def _update_device_tile(self, tile: Tile, grad: torch.Tensor) -> None:
        t = self.worker.steps_begun - 1  # this step's update number
        with self.timeline.stream(COMPUTE, self.dev.compute, f"adamw {tile.name}"):
            w = self.worker  # the same settings and schedule as the host tiles' updates
            adamw(tile, 0, tile.layout.numel, grad, t + 1, lr_at(t, w.cfg, w.total_steps), w.cfg, 1.0)
        tile.version += 1
        tile.updated = self.dev.record(self.dev.compute)

    def _clip_and_update_device_tiles(self) -> None:
        """The global norm on the device, as torch's clip_grad_norm_; no host sync."""
        norm = self.sq.sum().sqrt()
        scale = (self.worker.cfg.max_grad_norm / (norm + 1e-6)).clamp(max=1.0).float()
        for tile, grad in self._clip_later:
            grad.mul_(scale)
            self._update_device_tile(tile, grad)
        self._clip_later.clear()

    def _to_host(self, src: torch.Tensor, dst: torch.Tensor, name: str, submit) -> None:
        """D2H on the gradient stream after the backward-done event; hand the slab to the optimizer."""
        stream = self.dev.compute if self.sync_grads else self.dev.d2h
        backward_done = self.dev.record(self.dev.compute)
        with self.dev.on(stream):
            self.dev.wait(stream, backward_done)
            with self.timeline.stream(D2H, stream, name):
                dst.copy_(src, non_blocking=True)
            if self.dev.is_cuda:
                src.record_stream(stream)  # the allocator must not reuse src before the copy ran
            submit(self.dev.record(stream))
        self.bytes_d2h += src.numel() * src.itemsize
        if self.sync_grads:
            self.worker.flush()  # ablation: the gradient is consumed before compute goes on

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
        self.worker.flush()
        self.worker.close()

