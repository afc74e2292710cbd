"""The step's schedule: every op of one training step, in order, from the run's settings.

One list drives both the weight prefetcher (the units the ops load, in order) and the engine's
loop (one handler per op kind), so the two cannot disagree; the same object says which layers
are recomputed and how many FLOPs the hardware executes.

Each layer has an activation policy (`Policy`): what it keeps from its forward for its backward.
With L layers, K = checkpoint_every and the last N layers kept from recompute ("keep_graph"), the
layers 0..L-N-1 form blocks of K (the last may be shorter), each with a checkpoint of its input,
and each kept layer is a block of its own. Of the recomputed layers, the last A whose attention
can be kept (kept_attention.py; engine.keep_attention_layers) keep its output from the forward
("keep_attention"), so their recompute runs no attention core; the others keep nothing
("recompute"). For M micro-batches:
  Embed                                    every micro-batch's embedding rows, its masks and rotary
  [SaveCheckpoint i] Forward i             for i = 0..L-1 (a checkpoint at each block's first layer)
  Head                                     loss, its gradient and the gradient into the last layer
  per block, last first:
    TakeCheckpoint s, PrefetchCheckpoint s' (a recomputed block; s' the previous recomputed block)
    PrefetchAttention j                    each layer j of block s' that keeps its attention in host
                                           memory: every micro-batch's (activations.py)
    per micro-batch m:
      Recompute s..e-1 (m)                 a small graph per layer (kept layers: none; with the
                                           attention kept, that layer's attention output)
      Backward e-1..s (m)                  each graph run and released; at m = M-1 the layer's
                                           step gradient returns to the host
      EmbeddingBackward (m)                after layer 0
  EmbeddingGradient                        the embedding's step gradient returns
An evaluation runs the same loop over Embed, Forward 0..L-1 and HeadLoss (evaluation_ops).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from megatrain.kept_attention import keepable_layers
from megatrain.metrics import attention_flops, model_flops, recompute_flops
from megatrain.shapes import ModelShape

HEAD = "head"  # the unit of the head's op (final norm and LM head; the embedding too when tied)
# what a layer keeps from its forward for its backward: its block's checkpoint only (its forward runs
# again), its attention's output too (the recompute runs no attention core), or its whole graph
Policy = Literal["recompute", "keep_attention", "keep_graph"]


@dataclass(frozen=True)
class Embed:
    loads = None


@dataclass(frozen=True)
class SaveCheckpoint:
    layer: int  # the first layer of a recomputed block: every micro-batch's input is kept
    loads = None


@dataclass(frozen=True)
class Forward:
    layer: int
    keep_graph: bool  # a layer kept from recompute: its graph is built now and kept to its backward
    keep_attention: bool = False  # a recomputed layer whose recompute takes its attention's output from here
    offload_attention: bool = False  # ... kept in host memory until then

    @property
    def loads(self) -> int:
        return self.layer


@dataclass(frozen=True)
class Head:
    loads = HEAD


@dataclass(frozen=True)
class HeadLoss:
    """The loss alone, no gradient: an evaluation's head."""
    loads = HEAD


@dataclass(frozen=True)
class TakeCheckpoint:
    layer: int
    loads = None


@dataclass(frozen=True)
class PrefetchCheckpoint:
    layer: int  # the next recomputed block's first layer: its checkpoints start back now
    loads = None


@dataclass(frozen=True)
class PrefetchAttention:
    layer: int  # a layer of the next recomputed block that keeps its attention: back now, if offloaded
    loads = None


@dataclass(frozen=True)
class Recompute:
    layer: int
    mb: int
    root_only: bool  # the block's last layer: only the backward reads its output (unread_mlp.py)
    kept_attention: bool = False  # its attention's output from the forward (kept_attention.py)

    @property
    def loads(self) -> int:
        return self.layer


@dataclass(frozen=True)
class Backward:
    layer: int
    mb: int
    recomputed: bool  # its graph comes from Recompute (else from its Forward)
    first: bool  # the step's first micro-batch through this layer: the gradient accumulator starts
    last: bool  # the last: the layer's step gradient returns to the host after it

    @property
    def loads(self) -> int:
        return self.layer


@dataclass(frozen=True)
class EmbeddingBackward:
    mb: int
    loads = None


@dataclass(frozen=True)
class EmbeddingGradient:
    loads = None


Op = (Embed | SaveCheckpoint | Forward | Head | HeadLoss | TakeCheckpoint | PrefetchCheckpoint
      | PrefetchAttention | Recompute | Backward | EmbeddingBackward | EmbeddingGradient)


def evaluation_ops(num_layers: int) -> tuple[Op, ...]:
    """An evaluation: the step's forward (no checkpoints, no graphs kept), then the loss alone."""
    return (Embed(), *(Forward(i, keep_graph=False) for i in range(num_layers)), HeadLoss())


@dataclass(frozen=True)
class Block:
    start: int
    end: int
    recomputed: bool


def blocks(num_layers: int, checkpoint_every: int, no_recompute_layers: int) -> list[Block]:
    """The step's blocks in forward order: the recomputed layers in blocks of checkpoint_every (the
    last may be shorter), then each layer kept from recompute a block of its own. The schedule's ops
    and the memory plan's checkpoints and activations (memory.plan) both follow these."""
    L, K, R = num_layers, checkpoint_every, num_layers - no_recompute_layers
    return [Block(s, min(s + K, R), True) for s in range(0, R, K)] + [Block(i, i + 1, False) for i in range(R, L)]


def layers_keeping_attention(shape: ModelShape, seq_len: int, no_recompute_layers: int, count: int) -> tuple[int, ...]:
    """The recomputed layers that keep their attention: the last `count` of those that can
    (kept_attention.keepable_layers), as the layers kept from recompute are the last: their backward
    comes first, so what they keep is held the shortest. Of these, the first
    offloaded_attention_layers (held the longest) keep it in host memory."""
    keepable = [i for i in keepable_layers(shape, seq_len) if i < shape.num_layers - no_recompute_layers]
    return tuple(keepable[len(keepable) - min(count, len(keepable)):])


class Schedule:
    def __init__(self, num_layers: int, checkpoint_every: int, no_recompute_layers: int, microbatches: int,
                 keep_attention: Sequence[int] = (), offload_attention: Sequence[int] = ()):
        """`keep_attention`: the recomputed layers that keep their attention (layers_keeping_attention);
        `offload_attention`: those of them that keep it in host memory."""
        L, M = num_layers, microbatches
        self.recomputed_layers = L - no_recompute_layers  # layers 0..this-1 run their forward twice
        R = self.recomputed_layers
        assert all(i < R for i in keep_attention)
        self.attention_kept = tuple(keep_attention)
        self.attention_offloaded = tuple(offload_attention)
        assert set(offload_attention) <= set(keep_attention)
        self.policy: tuple[Policy, ...] = tuple("keep_graph" if i >= R else "keep_attention" if i in keep_attention
                                                else "recompute" for i in range(L))
        self.blocks = blocks(L, checkpoint_every, no_recompute_layers)
        ops: list[Op] = [Embed()]
        starts = {b.start for b in self.blocks if b.recomputed}
        for i in range(L):
            if i in starts:
                ops.append(SaveCheckpoint(i))
            ops.append(Forward(i, keep_graph=i >= R, keep_attention=self.policy[i] == "keep_attention",
                               offload_attention=i in self.attention_offloaded))
        ops.append(Head())
        for b in reversed(range(len(self.blocks))):
            block = self.blocks[b]
            if block.recomputed:
                ops.append(TakeCheckpoint(block.start))
            if b > 0 and self.blocks[b - 1].recomputed:
                before = self.blocks[b - 1]
                ops.append(PrefetchCheckpoint(before.start))  # overlaps this block's compute
                ops += [PrefetchAttention(j) for j in range(before.start, before.end) if j in self.attention_offloaded]
            for m in range(M):
                if block.recomputed:
                    ops += [Recompute(i, m, root_only=i == block.end - 1,
                                      kept_attention=self.policy[i] == "keep_attention")
                            for i in range(block.start, block.end)]
                ops += [Backward(i, m, block.recomputed, first=m == 0, last=m == M - 1)
                        for i in reversed(range(block.start, block.end))]
                if block.start == 0:
                    ops.append(EmbeddingBackward(m))
        ops.append(EmbeddingGradient())
        self.ops: tuple[Op, ...] = tuple(ops)

    @property
    def loads(self) -> list[int | str]:
        """The weight unit of each op that computes (a layer index or HEAD), in order: the prefetch plan."""
        return [op.loads for op in self.ops if op.loads is not None]

    @property
    def recomputed_blocks(self) -> int:
        return sum(b.recomputed for b in self.blocks)

    def hardware_flops(self, shape: ModelShape, mlp_chunk: int | None, seq_lengths: list[int],
                       kept_lengths: Sequence[int] = (), lean_experts: bool = False) -> float:
        """FLOPs the step executes: the model's, plus the recomputed layers' second forward, less the
        MLP projections a recomputed block's last layer leaves out (unread_mlp.py; a mixture's experts'
        with the lean experts' compiled gate, `lean_experts`), plus the chunked MLP's gate and up
        projections that every backward runs again (chunked_mlp.py), less the attention core of the
        layers that keep it, for the sequences whose micro-batch kept it (`kept_lengths`: by the
        engine's StepResult.attention_kept; a micro-batch with a mask did not)."""
        R = self.recomputed_layers  # the first R layers: the last no_recompute_layers keep their graphs
        flops = model_flops(shape.matmul_params(), shape.attention(), seq_lengths)
        flops += recompute_flops(sum(shape.layer_matmul_params(i) for i in range(R)), shape.attention(range(R)), seq_lengths)
        flops -= attention_flops(shape.attention(self.attention_kept), list(kept_lengths))
        mlp = shape.mlp_matmul_params()
        unread = mlp * self.recomputed_blocks if mlp_chunk else \
            sum(shape.unread_params(b.end - 1, lean_experts) for b in self.blocks if b.recomputed)
        flops -= sum(2 * n * unread for n in seq_lengths)
        if mlp_chunk:
            flops += sum(2 * n * 2 * mlp // 3 * shape.num_layers for n in seq_lengths)
        return flops
