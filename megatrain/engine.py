"""The schedule: the one forward/backward body of a training step, over three streams and events.

One micro-batch, as the ops the weight streamer sees (units in brackets):
  embed      host gathers the batch's embedding rows from the pinned shadow -> H2D
  forward    [layer i] for i = 0..L-1 under no_grad; the input of every K-th layer is kept
  head       [head] chunked norm + LM head + cross-entropy, forward and backward at once
  blocks     for each block of K layers, last block first:
               recompute [layer s..e-1] from the block's checkpoint, building one small
                 autograd graph per layer (its input is a fresh leaf);
               backward [layer e-1..s], each graph released as soon as it has run
  embed      D2H of the input gradient; the optimizer adds it into the embedding rows

Weights saved by the recompute graphs are not kept: a saved-tensor hook records which unit and
offset they came from, and the backward reads them from wherever that unit is resident then.
Each op's parameter gradients go to the gradient stream as one flat copy into a pinned slab;
the CPU optimizer accumulates them and updates the tile (see optim.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatrain.arch import Architecture
from megatrain.buffers import SlabPool, Unit, WeightStreamer
from megatrain.config import EngineConfig, OptimConfig
from megatrain.device import Device
from megatrain.loss import head_loss_and_grads, shift_labels
from megatrain.optim import OptimizerWorker
from megatrain.store import HostStore


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
        L, K = arch.num_layers, cfg.checkpoint_every
        self.blocks = [(s, min(s + K, L)) for s in range(0, L, K)]
        numel = max(u.numel for u in [*self.layer_units, self.head_unit])
        self.streamer = WeightStreamer(device, cfg.weight_buffers, numel, compute_dtype)
        pinned = device.is_cuda
        slab = max(numel, max_tokens * arch.hidden)  # also carries the embedding's input gradient
        self.slabs = SlabPool(max(1, cfg.grad_slabs), slab, compute_dtype, pinned)
        self.sync_grads = cfg.grad_slabs == 0
        self.rows = torch.empty(max_tokens * arch.hidden, dtype=compute_dtype, pin_memory=pinned)
        self.rows_free = device.event()
        self.max_tokens = max_tokens
        self.worker = OptimizerWorker(store.tiles, optim, total_steps)
        self.rotary = arch.rotary(device.torch)
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
        expected = {tile: M for tile in self.store.tiles}
        if self.arch.tied:
            expected[self.store.embed] += M  # the head's gradient lands in the embedding too
        self.worker.begin_step(expected)
        plan = []
        for _ in microbatches:
            plan += self.layer_units + [self.head_unit]
            for s, e in reversed(self.blocks):
                plan += self.layer_units[s:e] + self.layer_units[s:e][::-1]
        self.streamer.start(plan)
        h2d0, d2h0 = self.streamer.bytes_h2d, self.bytes_d2h
        wait_update0, wait_slab0 = self.streamer.wait_s, self.slabs.wait_s
        loss = torch.zeros((), dtype=torch.float32, device=self.dev.torch)
        op = 0
        with self.dev.on(self.dev.compute):
            for mb, tgt in zip(microbatches, targets):
                part, op = self._microbatch(mb, tgt, 1.0 / n_targets, op)
                loss += part
        self.worker.finish_step()
        self.dev.synchronize()  # the step boundary: the only host-device sync of a step
        loss_value = float(loss) / n_targets
        lengths = []
        for mb in microbatches:
            mask = mb.attention_mask if mb.attention_mask is not None else torch.ones_like(mb.input_ids)
            lengths += [int(n) for n in mask.sum(dim=1)]
        prev = self.worker.grad_norms.get(self.worker.steps_begun - 2)  # written before this step's forward ended
        return StepResult(loss_value, n_targets, lengths, time.perf_counter() - start, prev,
                          self.streamer.bytes_h2d - h2d0, self.bytes_d2h - d2h0,
                          self.streamer.wait_s - wait_update0, self.slabs.wait_s - wait_slab0)

    def _microbatch(self, mb: Batch, targets: torch.Tensor, scale: float, op: int) -> tuple[torch.Tensor, int]:
        dev, stream = self.dev, self.streamer
        B, S = mb.input_ids.shape
        h = self._embed(mb.input_ids)
        ctx = self._context(h, mb.attention_mask)
        # forward: no graph; keep the input of every block
        checkpoints = {}
        with torch.no_grad():
            for i in range(self.arch.num_layers):
                if i % self.cfg.checkpoint_every == 0:
                    checkpoints[i] = h
                h = self._layer(i, stream.acquire(op), h, ctx)
                stream.release(op)
                op += 1
        # head: loss, its gradient, and the gradient flowing into the last layer
        w = stream.acquire(op)
        chunk = self.cfg.loss_chunk_tokens
        active = [bool((targets[lo: lo + chunk] != -100).any()) for lo in range(0, targets.numel(), chunk)]
        loss, dh, d_norm, d_head = head_loss_and_grads(
            h.reshape(B * S, -1), targets.to(dev.torch, non_blocking=True), active,
            self.arch.norm_template(), w[0], w[-1], chunk, scale)
        self._offload(self.head_unit, [d_norm, d_head])
        stream.release(op)
        op += 1
        dh = dh.view(B, S, -1)
        # blocks in reverse: recompute with small graphs, then backward layer by layer
        for s, e in reversed(self.blocks):
            x = checkpoints.pop(s)
            graphs = []
            for i in range(s, e):
                leaves = [v.detach().requires_grad_() for v in stream.acquire(op)]
                x = x.detach().requires_grad_()
                self._packing = self.layer_units[i]
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    out = self._layer(i, leaves, x, ctx)
                graphs.append((x, leaves, out))
                x = out
                stream.release(op)
                op += 1
            for i in reversed(range(s, e)):
                stream.acquire(op)  # the weights the unpack hook will read
                x, leaves, out = graphs.pop()
                grads = torch.autograd.grad(out, [x, *leaves], dh)
                dh = grads[0]
                del x, leaves, out
                self._offload(self.layer_units[i], grads[1:])
                stream.release(op)
                op += 1
        self._embed_backward(mb.input_ids, dh)
        return loss, op

    # ------------------------------------------------------------------ pieces
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
        """Gather the batch's rows of the embedding on the host and send only those."""
        tile = self.store.embed
        start = time.perf_counter()
        tile.ready.wait()
        self.streamer.wait_s += time.perf_counter() - start
        n = ids.numel()
        table = tile.shadow[: tile.layout.specs[0].numel].view(tile.layout.specs[0].shape)
        self.rows_free.synchronize()  # the previous micro-batch's copy out of `rows` is done
        rows = self.rows[: n * self.arch.hidden].view(n, self.arch.hidden)
        torch.index_select(table, 0, ids.reshape(-1), out=rows)
        h = torch.empty(ids.shape + (self.arch.hidden,), dtype=self.dtype, device=self.dev.torch)
        with self.dev.on(self.dev.h2d):
            h.view(n, -1).copy_(rows, non_blocking=True)
            self.rows_free = ready = self.dev.record(self.dev.h2d)
        self.streamer.bytes_h2d += rows.numel() * rows.itemsize
        self.dev.wait(self.dev.compute, ready)
        return h

    def _embed_backward(self, ids: torch.Tensor, dh: torch.Tensor) -> None:
        ids = ids.reshape(-1)
        if self.arch.padding_idx is not None:  # nn.Embedding(padding_idx=...) gives that row no gradient
            keep = ids != self.arch.padding_idx
            ids, dh = ids[keep], dh.reshape(-1, dh.shape[-1])[keep.to(dh.device)]
        rows = dh.reshape(-1, dh.shape[-1])
        slab = self.slabs.acquire()
        host = slab[: rows.numel()].view(rows.shape)
        self._to_host(rows, host, lambda event: self.worker.submit_rows(
            self.store.embed, ids, host, event, lambda: self.slabs.release(slab)))

    def _offload(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        """Pack a unit's gradients into one flat buffer and return it to a pinned slab in one copy."""
        flat = torch.zeros(unit.numel, dtype=self.dtype, device=self.dev.torch)  # padding stays zero
        for view, grad in zip(unit.views(flat), grads, strict=True):
            view.copy_(grad)
        slab = self.slabs.acquire()
        self._to_host(flat, slab[: unit.numel], lambda event: self.worker.submit_dense(
            unit.segments, slab, event, self.slabs.release))

    def _to_host(self, src: torch.Tensor, dst: torch.Tensor, submit) -> None:
        """D2H on the gradient stream after the backward-done event; hand the slab to the optimizer."""
        stream = self.dev.compute if self.sync_grads else self.dev.d2h
        backward_done = self.dev.record(self.dev.compute)
        with self.dev.on(stream):
            self.dev.wait(stream, backward_done)
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
