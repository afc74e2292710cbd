"""The step's schedule (megatrain/schedule.py): every op once in step order, the loads the prefetcher
gets, and the FLOPs the hardware executes with the recompute it runs."""
from __future__ import annotations



from helpers import shape_of


def test_schedule_lists_every_op_once_in_step_order():
    """5 layers, K = 2, the last layer kept from recompute, 2 micro-batches: blocks [0, 2) [2, 4)
    recomputed and [4] kept; the loads the prefetcher gets are exactly the computing ops' units."""
    from megatrain.schedule import (HEAD, Backward, Embed, EmbeddingBackward, EmbeddingGradient, Forward, Head,
                                    PrefetchCheckpoint, Recompute, SaveCheckpoint, Schedule, TakeCheckpoint)
    s = Schedule(num_layers=5, checkpoint_every=2, no_recompute_layers=1, microbatches=2)
    assert s.recomputed_layers == 4 and s.recomputed_blocks == 2
    expected = [Embed(), SaveCheckpoint(0), Forward(0, False), Forward(1, False), SaveCheckpoint(2), Forward(2, False),
                Forward(3, False), Forward(4, True), Head(),
                PrefetchCheckpoint(2)]
    for m in range(2):  # the kept layer: its forward's graph, no recompute
        expected += [Backward(4, m, False, m == 0, m == 1)]
    expected += [TakeCheckpoint(2), PrefetchCheckpoint(0)]
    for m in range(2):
        expected += [Recompute(2, m, False), Recompute(3, m, True),
                     Backward(3, m, True, m == 0, m == 1), Backward(2, m, True, m == 0, m == 1)]
    expected += [TakeCheckpoint(0)]
    for m in range(2):
        expected += [Recompute(0, m, False), Recompute(1, m, True),
                     Backward(1, m, True, m == 0, m == 1), Backward(0, m, True, m == 0, m == 1), EmbeddingBackward(m)]
    expected += [EmbeddingGradient()]
    assert list(s.ops) == expected
    assert s.loads == [0, 1, 2, 3, 4, HEAD, 4, 4, 2, 3, 3, 2, 2, 3, 3, 2, 0, 1, 1, 0, 0, 1, 1, 0]


def test_kept_attention_comes_back_one_block_ahead():
    """Layers 1 and 2 keep their attention (K = 2), both in host memory: the recompute takes each
    one's, and layer 1's (of block [0, 2)) is brought back with that block's checkpoints, while
    block [2, 4) runs; layer 2's, of the first block the backward reaches, when its recompute takes
    it. Kept on the device, nothing is brought back."""
    from megatrain.schedule import Forward, PrefetchAttention, PrefetchCheckpoint, Recompute, Schedule
    s = Schedule(num_layers=4, checkpoint_every=2, no_recompute_layers=0, microbatches=2, keep_attention=(1, 2),
                 offload_attention=(1, 2))
    ops = list(s.ops)
    assert [op.layer for op in ops if isinstance(op, Forward) and op.keep_attention and op.offload_attention] == [1, 2]
    assert not any(isinstance(op, PrefetchAttention) for op in Schedule(4, 2, 0, 2, keep_attention=(1, 2)).ops)
    assert [op for op in ops if isinstance(op, PrefetchAttention)] == [PrefetchAttention(1)]
    assert ops.index(PrefetchAttention(1)) == ops.index(PrefetchCheckpoint(0)) + 1 < ops.index(Recompute(2, 0, False, True))
    assert [(op.layer, op.mb) for op in ops if isinstance(op, Recompute) and op.kept_attention] == [
        (2, 0), (2, 1), (1, 0), (1, 1)]


def test_hardware_flops_count_the_recompute_the_schedule_runs():
    """Model FLOPs plus one forward of each recomputed layer (a third of 6N + 12Lhs per layer), less
    the down projection a recomputed block's last layer leaves out; chunked, less its whole MLP and
    plus every layer's gate and up projections again."""
    from megatrain.metrics import model_flops
    from megatrain.schedule import Schedule
    shape = shape_of("tiny-llama", num_hidden_layers=4)
    lengths = [16, 9]
    model = model_flops(shape.matmul_params(), shape.attention(), lengths)
    layer = sum(n * (2 * shape.layer_matmul_params() + 4 * shape.hidden * n) for n in lengths)
    mlp = sum(2 * n * shape.mlp_matmul_params() for n in lengths)  # one forward of the MLP's three projections
    s = Schedule(4, checkpoint_every=2, no_recompute_layers=1, microbatches=1)  # blocks [0, 2) [2, 3) [3]
    assert s.hardware_flops(shape, None, lengths) == model + 3 * layer - 2 * mlp // 3
    assert s.hardware_flops(shape, 8, lengths) == model + 3 * layer - 2 * mlp + 4 * 2 * mlp // 3
    assert Schedule(4, 1, 4, 1).hardware_flops(shape, None, lengths) == model
