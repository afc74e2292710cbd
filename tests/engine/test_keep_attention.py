"""engine.keep_attention_layers (kept_attention.py): recomputed layers take their attention's output
from the forward. The attention is the library's SDPA to the bit (its kernel, the CPU's flash
attention for float32 and bfloat16 alike), so training is the recomputing run's to the bit; where a
micro-batch has a mask (padding), a window is narrower than the sequence or the attention is not
SDPA, the layer recomputes it. tests/engine/test_engine_reference.py holds these runs to the reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from helpers import random_batches, store_params, tiny_checkpoint
from megatrain import kept_attention, memory, planning
from megatrain.config import DataConfig, EngineConfig, ModelConfig, OptimConfig, load_config
from megatrain.metrics import attention_flops, model_flops
from megatrain.resolve import Machine, resolve
from megatrain.schedule import Schedule
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.trainer import Trainer

SEQ, BATCH = 16, 2


def shape_of(preset: str, **overrides) -> ModelShape:
    return ModelShape(load_hf_config(ModelConfig(preset=preset, overrides=overrides), cuda=False))


class _Attention(torch.nn.Module):
    """What the library's SDPA function reads of an attention module."""
    is_causal = True

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_kept_attention_is_the_librarys_to_the_bit(dtype, kv_heads):
    """Output, and the gradients of q, k and v through the kept output, equal the library's SDPA
    attention's (with and without grouped queries); with a mask it keeps nothing."""
    gen = torch.Generator().manual_seed(0)
    module = _Attention(4 // kv_heads)
    q = torch.randn(2, 16, 4, 16, generator=gen).to(dtype).transpose(1, 2)  # as the layers pass them
    k, v = (torch.randn(2, 16, kv_heads, 16, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    dout = torch.randn(2, 16, 4, 16, generator=gen).to(dtype)

    def grads(call):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = call(module, *leaves, None, scaling=0.3)
        return out, torch.autograd.grad(out, leaves, dout)
    with torch.no_grad(), kept_attention.keeping() as kept:
        forward, _ = kept_attention.attention(module, q, k, v, None, scaling=0.3)
    assert len(kept) == 1 and kept[0].out.dtype == dtype and kept[0].state[0].dtype == torch.float32
    with kept_attention.reusing(kept[0]):
        out, reused = grads(kept_attention.attention)
    library_out, library = grads(sdpa_attention_forward)
    torch.testing.assert_close((forward, out, *reused), (library_out, library_out, *library), rtol=0, atol=0)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).tril()
    with torch.no_grad(), kept_attention.keeping() as kept:
        kept_attention.attention(module, q, k, v, mask, scaling=0.3)
    assert not kept


def three_steps(tmp_path, preset, overrides, engine, pad, compute="float32"):
    """Three steps (K = 2, two micro-batches, clipping): losses, hardware over model FLOPs, weights."""
    cfg = load_config(base={
        "model": {"pretrained": str(tmp_path / "init")},
        "engine": {"device": "cpu", "compute_dtype": compute, "checkpoint_every": 2, "loss_chunk_tokens": 7, **engine},
        "optim": {"lr": 1e-3, "weight_decay": 0.1, "max_grad_norm": 0.5},
        "data": {"seq_len": SEQ, "batch_size": BATCH, "grad_accum": 2}, "steps": 3})
    trainer = Trainer(cfg)
    try:
        steps = [trainer.train_step(mbs) for mbs in random_batches(3, 2, BATCH, SEQ, trainer.shape.vocab, pad)]
        return ([m["loss"] for m in steps], [m["hardware_tflops"] / m["model_tflops"] for m in steps],
                store_params(trainer), trainer.settings, trainer.engine.schedule(2))
    finally:
        trainer.close()


@pytest.mark.parametrize("preset, engine, overrides, pad, compute, kept", [
    # more than can (9): every layer, grouped queries, tied; and in bfloat16 (the CPU's flash attention too)
    ("tiny-qwen2", {"keep_attention_layers": 9}, {}, False, "float32", [0, 1, 2]),
    ("tiny-qwen2", {"keep_attention_layers": 9}, {}, False, "bfloat16", [0, 1, 2]),
    # fused q, k, v and partial rotary (Phi-3); a mixture of experts with the router's loss (Qwen3-MoE)
    ("tiny-phi3", {"keep_attention_layers": 9}, {}, False, "float32", [0, 1, 2]),
    ("tiny-qwen3-moe", {"keep_attention_layers": 9}, {}, False, "float32", [0, 1, 2]),
    # sliding, full, sliding (window 6 of 16 tokens), the last layer kept whole: the full layer alone
    ("tiny-gemma3", {"keep_attention_layers": 9, "no_recompute_layers": 1}, {}, False, "float32", [1]),
    # the last two of four, with the chunked MLP, device tiles and offloaded checkpoints
    ("tiny-llama", {"keep_attention_layers": 2, "mlp_chunk_tokens": 5, "device_tiles": 2, "offload_checkpoints": True},
     {"num_hidden_layers": 4}, False, "float32", [2, 3]),
    # offloaded to host memory (activations.KeptAttention): five layers in blocks of 2, 2 and 1, each
    # block's brought back one block ahead; in bfloat16; with padding (nothing kept, nothing moved)
    ("tiny-llama", {"keep_attention_layers": 9, "offload_attention": True}, {"num_hidden_layers": 5}, False,
     "float32", [0, 1, 2, 3, 4]),
    ("tiny-qwen2", {"keep_attention_layers": 9, "offload_attention": True}, {}, False, "bfloat16", [0, 1, 2]),
    # beside offloaded checkpoints and a last layer kept whole (its own block, no attention kept)
    ("tiny-llama", {"keep_attention_layers": 9, "offload_attention": True, "offload_checkpoints": True,
                    "no_recompute_layers": 1}, {"num_hidden_layers": 5}, False, "float32", [0, 1, 2, 3]),
    ("tiny-llama", {"keep_attention_layers": 9, "offload_attention": True}, {}, True, "float32", [0, 1, 2]),
    # padded micro-batches (a mask): planned, not kept; every layer a window narrower than the sequence: none
    ("tiny-llama", {"keep_attention_layers": 9}, {}, True, "float32", [0, 1, 2]),
    ("tiny-mistral", {"keep_attention_layers": 9}, {}, False, "float32", []),
])
def test_kept_attention_trains_as_the_recompute_to_the_bit(tmp_path, monkeypatch, preset, engine, overrides, pad,
                                                          compute, kept):
    """Losses and weights after 3 steps equal the recomputing run's to the bit; each planned layer
    keeps its attention for every micro-batch without a mask (the recompute takes it once per layer
    and micro-batch); the hardware FLOPs leave out those layers' attention forward."""
    tiny_checkpoint(tmp_path / "init", preset, overrides)
    reused = []
    forward = kept_attention._Reused.forward
    monkeypatch.setattr(kept_attention._Reused, "forward", staticmethod(lambda *a: reused.append(1) or forward(*a)))
    losses, ratios, params, settings, schedule = three_steps(tmp_path, preset, overrides, engine, pad, compute)
    assert settings.keep_attention_layers == len(kept) and schedule.attention_kept == tuple(kept)
    assert [i for i, p in enumerate(schedule.policy) if p == "keep_attention"] == kept
    assert len(reused) == (0 if pad else 3 * 2 * len(kept))
    recomputed = three_steps(tmp_path, preset, overrides, {**engine, "keep_attention_layers": 0,
                                                           "offload_attention": False}, pad, compute)
    torch.testing.assert_close((losses, params), (recomputed[0], recomputed[2]), rtol=0, atol=0)
    shape = ModelShape(load_hf_config(ModelConfig(pretrained=str(tmp_path / "init")), cuda=False))
    lengths = [SEQ] * BATCH * 2
    model = model_flops(shape.matmul_params(), shape.attention(), lengths)
    saved = 0 if pad else attention_flops(shape.attention(kept), lengths)
    for ratio, again in zip(ratios, recomputed[1]):
        assert ratio == pytest.approx(again - saved / model, rel=1e-12)


def test_offloaded_attention_crosses_the_link_once_each_way(tmp_path):
    """engine.offload_attention: each kept (layer, micro-batch) attention goes to host memory after its
    forward and comes back before its recompute, its output and log-sum-exp once each way a step (the
    step's bytes moved), and the engine holds none of it after the step."""
    preset, overrides = "tiny-llama", {"num_hidden_layers": 4}
    tiny_checkpoint(tmp_path / "init", preset, overrides)
    moved = []
    for offload in (False, True):
        cfg = load_config(base={
            "model": {"pretrained": str(tmp_path / "init")},
            "engine": {"device": "cpu", "checkpoint_every": 2, "keep_attention_layers": 3, "offload_attention": offload},
            "data": {"seq_len": SEQ, "batch_size": BATCH, "grad_accum": 2}, "steps": 1})
        trainer = Trainer(cfg)
        try:
            m = trainer.train_step(random_batches(1, 2, BATCH, SEQ, trainer.shape.vocab, False)[0])
            moved.append((m["bytes_h2d"], m["bytes_d2h"]))
            assert not trainer.engine.attention.kept
            shape = trainer.shape
        finally:
            trainer.close()
    kept = 3 * 2 * kept_attention.kept_bytes(shape, BATCH * SEQ, 4)
    assert moved[1] == (moved[0][0] + kept, moved[0][1] + kept)


def test_offloaded_attention_is_planned_on_the_host():
    """With offload_attention the device plan holds two blocks' kept attention at most (K = 2: four
    layers of the 7B's 28) and the host plan every kept layer's, in pinned memory."""
    shape = shape_of("qwen2.5-7b")
    data = DataConfig(seq_len=4096, batch_size=8, grad_accum=2)

    def planned(offload):  # no device bound: every kept layer the device does not hold, all of them
        engine = EngineConfig(keep_attention_layers=20, offload_attention=offload, checkpoint_every=2,
                              compute_dtype="bfloat16", device_tiles=0)
        return memory.plan(shape, resolve(engine, data, OptimConfig(), shape, Machine(True, None, 2**50)))
    on_device, offloaded = planned(False), planned(True)
    one = kept_attention.kept_bytes(shape, 8 * 4096, 2)
    assert on_device.detail["device.kept_attention"] == 20 * 2 * one
    assert offloaded.detail["device.kept_attention"] == 4 * 2 * one
    parts = kept_attention.kept_parts(shape, 8 * 4096, 2)  # registered at their size, each page-aligned
    assert offloaded.detail["attention_offload"] == 20 * 2 * sum(-(-n // 4096) * 4096 for n in parts)
    assert on_device.detail["attention_offload"] == 0
    with pytest.raises(ValueError, match="engine.keep_attention_layers is 0"):
        EngineConfig(offload_attention=True, keep_attention_layers=0)


def test_offloaded_attention_keeps_the_layers_the_device_cannot():
    """auto with offload_attention, the 7B at one 524288-token sequence on an H200 (K = 2): the
    device holds the attention of a few layers, kept there as without offload; the host holds the
    rest, where it has room (on the device two blocks' of them in flight, for which the device keeps
    up to two blocks fewer of its own); where the host has room for only some, those. Never fewer
    layers keep their attention than without offload. A number asked for is kept, the most of it on
    the device that leaves room for the rest's blocks in flight."""
    shape = shape_of("qwen2.5-7b", max_position_embeddings=524288)
    data = DataConfig(seq_len=524288, batch_size=1)
    fixed = {"compute_dtype": "bfloat16", "device_tiles": 0, "grad_slabs": 4, "split_masters": False,
             "checkpoint_every": 2, "offload_checkpoints": True, "mlp_chunk_tokens": 65536}
    device = 139 * 2**30

    def resolved(host, **engine):
        return resolve(EngineConfig(**{**fixed, **engine}), data, OptimConfig(), shape, Machine(True, device, host))
    alone = resolved(2**50)
    assert 0 < alone.keep_attention_layers < 28 and alone.offloaded_attention_layers == 0
    ample = resolved(2**50, offload_attention=True)
    on_device = ample.keep_attention_layers - ample.offloaded_attention_layers
    assert ample.keep_attention_layers == 28 and alone.keep_attention_layers - 4 <= on_device <= alone.keep_attention_layers
    assert memory.plan(shape, ample).device_bytes + memory.DEVICE_WORKSPACE <= device
    host_of = {n: memory.plan(shape, replace(ample, keep_attention_layers=on_device + n, offloaded_attention_layers=n))
               .host_bytes for n in (9, 10)}
    some = resolved(host_of[9] + (host_of[10] - host_of[9]) // 2, offload_attention=True)
    assert some.offloaded_attention_layers >= 9 and some.keep_attention_layers >= alone.keep_attention_layers
    assert memory.plan(shape, some).host_bytes <= host_of[9] + (host_of[10] - host_of[9]) // 2
    asked = resolved(2**50, offload_attention=True, keep_attention_layers=28)  # a number: split as auto's
    assert (asked.keep_attention_layers, asked.offloaded_attention_layers) == (28, ample.offloaded_attention_layers)
    none = resolved(memory.plan(shape, alone).host_bytes, offload_attention=True)
    assert none.keep_attention_layers == alone.keep_attention_layers and none.offloaded_attention_layers == 0


def test_the_plan_keeps_attention_where_the_device_has_room():
    """auto: none without a device bound (the CPU), else as many recomputed layers as fit after the
    device tiles and the layers kept whole, the last first; a number: at most those that can; none
    where the attention is not SDPA (Gemma 2's soft-capping: eager on the CPU)."""
    shape = shape_of("qwen2.5-7b")  # 28 layers
    data = DataConfig(seq_len=4096, batch_size=8)

    def resolved(device_free, **engine):
        engine = EngineConfig(**{"device_tiles": 0, "compute_dtype": "bfloat16", **engine})
        return resolve(engine, data, OptimConfig(), shape, Machine(True, device_free, 2**50))
    assert resolve(EngineConfig(), data, OptimConfig(), shape, Machine(False, None, 2**50)).keep_attention_layers == 0
    assert resolved(2**50).keep_attention_layers == 28
    assert resolved(2**50, no_recompute_layers=3).keep_attention_layers == 25
    assert resolved(None, keep_attention_layers=99).keep_attention_layers == 28
    none = memory.plan(shape, resolved(None, keep_attention_layers=0))
    per_layer = memory.plan(shape, resolved(None, keep_attention_layers=1)).device_bytes - none.device_bytes
    room = none.device_bytes + memory.DEVICE_WORKSPACE + 5 * per_layer + per_layer // 2
    assert resolved(room).keep_attention_layers == 5
    assert Schedule(28, 4, 0, 1, (23, 24, 25, 26, 27)).policy[22:] == ("recompute",) + ("keep_attention",) * 5
    gemma = shape_of("tiny-gemma2")
    assert gemma.config._attn_implementation == "eager"
    assert resolve(EngineConfig(keep_attention_layers=3), DataConfig(seq_len=4), OptimConfig(), gemma,
                   Machine(False, None, 2**50)).keep_attention_layers == 0


def test_long_sequences_keep_attention_before_device_tiles():
    """auto on a 7B with an H200's room: at 8 x 4096 tokens (2 micro-batches) the device tiles take
    the room first (the attention's recompute, 5.4e13 FLOPs, costs less than the host's update of the
    embedding and layer 0, 7.8e8 parameters); at one sequence of 131072 tokens (3.4e15 FLOPs) every
    layer keeps its attention and the tiles take what is left."""
    shape = shape_of("qwen2.5-7b", max_position_embeddings=131072)
    machine = Machine(True, 139 * 2**30, 2**50)  # an H200 free

    def resolved(seq_len, batch_size, grad_accum):
        return resolve(EngineConfig(compute_dtype="bfloat16"), DataConfig(seq_len=seq_len, batch_size=batch_size,
                       grad_accum=grad_accum), OptimConfig(), shape, machine)
    short, long = resolved(4096, 8, 2), resolved(131072, 1, 1)
    assert short.device_tiles > 20 and short.keep_attention_layers < 28
    assert long.keep_attention_layers == 28
    tiles_first = resolve(EngineConfig(compute_dtype="bfloat16", keep_attention_layers=0), DataConfig(
        seq_len=131072, batch_size=1), OptimConfig(), shape, machine)
    assert long.device_tiles < tiles_first.device_tiles
    assert memory.plan(shape, long).device_bytes + memory.DEVICE_WORKSPACE <= machine.device_free


def test_the_memory_plan_counts_every_kept_attention():
    """Per layer and micro-batch: the output (tokens x heads x head_dim, bf16) and the float32
    log-sum-exp (heads x tokens), held from the forward to the backward: 7B at 8 x 4096 tokens,
    2 micro-batches, 5 layers."""
    shape = shape_of("qwen2.5-7b")  # 28 heads of 128
    engine = EngineConfig(keep_attention_layers=5, compute_dtype="bfloat16", device_tiles=0)
    s = resolve(engine, DataConfig(seq_len=4096, batch_size=8, grad_accum=2), OptimConfig(), shape,
                Machine(True, None, 2**50))
    tokens = 8 * 4096
    kept = 5 * 2 * (tokens * 28 * 128 * 2 + 28 * tokens * 4)
    p, none = memory.plan(shape, s), memory.plan(shape, replace(s, keep_attention_layers=0))
    assert p.detail["device.kept_attention"] == kept == p.device_bytes - none.device_bytes


def test_the_summary_says_how_many_layers_keep_their_attention():
    args = ["model.preset=tiny-qwen2", "engine.device=cpu", "data.seq_len=16", "data.batch_size=2", "steps=1",
            "engine.keep_attention_layers=2"]
    plan = planning.plan_run(load_config(None, args))
    assert plan.settings.keep_attention_layers == 2
    assert "0 layers kept from recompute, 2 keeping their attention" in plan.describe()
    offloaded = planning.plan_run(load_config(None, [*args, "engine.offload_attention=true"]))
    assert "2 keeping their attention (2 of them in host memory)" in offloaded.describe()
