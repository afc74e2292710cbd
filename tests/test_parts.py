"""Unit checks of the pieces: the learning-rate schedule, the store's layout, templates and Bind,
and the memory plan (the data: test_data.py)."""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import random_batches
from megatrain.config import DataConfig, EngineConfig, EngineSettings, ModelConfig, OptimConfig, load_config
import megatrain.store as store_module
from megatrain.memory import plan
from megatrain.optim import lr_at
from megatrain.resolve import Machine, resolve
from megatrain.shapes import ModelShape, ParamSpec, load_hf_config
from megatrain.store import ALIGN, PAGE, HostStore, Layout, Tile
from megatrain.templates import Architecture
from megatrain.trainer import Trainer


def shape_of(preset: str, **overrides) -> ModelShape:
    return ModelShape(load_hf_config(ModelConfig(preset=preset, overrides=overrides)))


def settings(shape: ModelShape, engine: EngineConfig | None = None, *, master="float32", compute="bfloat16",
             tokens=16384, microbatches=1, clipping=False, pinned=False, device_free=None,
             host=2**60) -> EngineSettings:
    """A run's resolved engine settings: one sequence of `tokens` per micro-batch, a device of
    `device_free` bytes (None: unbounded), `host` bytes of host memory, a GPU's pinned buffers
    where `pinned`."""
    engine = replace(engine or EngineConfig(), master_dtype=master, compute_dtype=compute)
    data = DataConfig(seq_len=tokens, grad_accum=microbatches)
    return resolve(engine, data, OptimConfig(max_grad_norm=1.0 if clipping else None), shape,
                   Machine(pinned, device_free, host))


SPLIT = EngineConfig(split_masters=True)


def test_lr_schedule():
    """transformers' warm-up (update t at t / warmup_steps of lr) and its cosine down to
    min_lr_ratio; tests/test_schedules.py holds every schedule to the library's."""
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.0, 0.25, 0.5, 0.75]
    assert lr_at(4, cfg, 14) == 1.0
    assert math.isclose(lr_at(9, cfg, 14), 0.55)  # halfway down the cosine
    assert math.isclose(lr_at(14, cfg, 14), 0.1)  # past it the library's cosine goes on: no run gets there
    assert lr_at(50, OptimConfig(lr=2.0, schedule="constant"), 10) == 2.0


def test_layout_is_aligned_and_decay_first():
    arch = shape_of("tiny-qwen2")
    layout = Layout.of(arch.layer_specs)
    assert all(o % ALIGN == 0 for o in layout.offsets)
    for spec, offset in zip(layout.specs, layout.offsets):
        assert (offset < layout.decay_numel) == spec.decay
    assert not HostStore(arch, settings(arch)).layers[0].split  # auto, with the host to spare: whole masters
    store = HostStore(arch, settings(arch, SPLIT, clipping=True))
    tile = store.layers[0]
    assert tile.split and tile.master is None  # float32 masters, bf16 shadow: the master's low halves only
    for t in (tile.low, tile.exp_avg, tile.exp_avg_sq, tile.grad, tile.shadow):
        assert t.data_ptr() % PAGE == 0
    # one layer-contiguous block: the low halves, moments and gradient buffer follow each other
    assert tile.exp_avg.data_ptr() > tile.low.data_ptr() and tile.grad.data_ptr() > tile.exp_avg_sq.data_ptr()
    assert arch.tied and [s.name for s in store.head.layout.specs] == ["norm.weight"]  # the LM head is the embedding


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_host_bytes_per_parameter(split):
    """float32 masters: 14 bytes per parameter without clipping (master, moments, bf16 shadow), 18
    with it (a float32 gradient waits for the global norm); split (engine.split_masters), 12 and 16:
    the master's low halves beside the shadow that is its high halves."""
    arch = shape_of("tiny-llama", num_hidden_layers=8)
    engine = EngineConfig(split_masters=split)
    for clipping, per_param in ((False, 14 - 2 * split), (True, 18 - 2 * split)):
        store = HostStore(arch, settings(arch, engine, clipping=clipping))
        layer = store.layers[0]
        assert layer.split == split and (layer.master is None) == split
        assert (layer.grad is not None) == clipping and (store.embed.grad is not None) == clipping
        per_layer = HostStore.nbytes(arch, settings(arch, engine, clipping=clipping))[0]
        deeper = shape_of("tiny-llama", num_hidden_layers=16)
        growth = HostStore.nbytes(deeper, settings(deeper, engine, clipping=clipping))[0] - per_layer
        # 8 more layers cost per_param bytes per parameter, each buffer rounded up to a page
        n = layer.layout.numel
        assert 8 * per_param * n <= growth <= 8 * (per_param * n + 5 * PAGE)


@pytest.mark.parametrize("master, split", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("chunk", [1 << 22, 64])
def test_drawn_weights_are_those_of_a_drawn_tensor(master, split, chunk, monkeypatch):
    """A tile's seeded draws, in place into a whole float32 master or through a tensor otherwise
    (in chunks, here also of 64 elements: 1961 = 29 x 64 + 105), are the numbers torch draws into a
    tensor of their own (the store's init did so before), in the master and in its bf16 shadow."""
    monkeypatch.setattr(store_module, "_DRAW", chunk)
    drawn = []
    write = Tile.write_master
    monkeypatch.setattr(Tile, "write_master", lambda self, values, lo=0: (drawn.append(values.numel()), write(self, values, lo)))
    specs = [ParamSpec("w.weight", (37, 53)), ParamSpec("v.weight", (129,))]
    tile = Tile("t", Layout.of(specs), master, torch.bfloat16, pinned=False, grad=False, split=split)
    tile.reset()
    gen = torch.Generator().manual_seed(7)
    for spec, offset in zip(tile.layout.specs, tile.layout.offsets):
        tile.draw_normal(offset, spec.numel, 0.02, gen)
    # drawn in place, or through tensors of at most two chunks (the last chunk takes the tail)
    assert (drawn == []) if (master, split) == (torch.float32, False) else (max(drawn) < 2 * chunk and sum(drawn) == 1961 + 129)
    gen = torch.Generator().manual_seed(7)
    for spec, offset in zip(tile.layout.specs, tile.layout.offsets):
        want = torch.empty(spec.shape).normal_(0.0, 0.02, generator=gen).reshape(-1)
        with tile.plain_state() as state:
            got = state["master"][offset: offset + spec.numel]
            assert torch.equal(got.float(), want.to(master).float())
        assert torch.equal(tile.shadow[offset: offset + spec.numel], want.to(torch.bfloat16))


def test_templates_hold_no_weights_and_keep_per_layer_behaviour():
    hf = load_hf_config(ModelConfig(preset="tiny-qwen2", overrides={
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 4}))
    arch = Architecture(ModelShape(hf))
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    for i in range(4):
        template = arch.template(i)
        assert not list(template.module.parameters())
        with torch.device("meta"):
            fresh = Qwen2DecoderLayer(hf, i)
        assert template.module.self_attn.sliding_window == fresh.self_attn.sliding_window
        assert template.module.self_attn.layer_type == fresh.self_attn.layer_type
        assert template.module.self_attn.layer_idx == i
    assert arch.template(0) is not arch.template(1)  # full and sliding layers use different templates
    specs = arch.shape.layer_specs
    weights = [torch.randn(s.shape) for s in specs]
    module = arch.template(2).bind(weights)
    assert module.mlp.up_proj.weight is weights[[s.name for s in specs].index("mlp.up_proj.weight")]


def test_memory_plan_counts_bytes_per_parameter():
    arch = shape_of("qwen2.5-7b")
    def per_param(master, clipping, engine=None):
        p = plan(arch, settings(arch, engine, master=master, microbatches=4, clipping=clipping))
        return p.detail["store"] / n
    n = arch.total_params()
    assert 7.5e9 < n < 7.7e9
    assert 13.99 < per_param("float32", False) < 14.01  # fp32 master + 2 moments + bf16 shadow
    assert 17.99 < per_param("float32", True) < 18.01  # + a float32 gradient waiting for the norm
    assert 11.99 < per_param("float32", False, SPLIT) < 12.01  # fp32 master as bf16 shadow + low halves
    assert 15.99 < per_param("float32", True, SPLIT) < 16.01
    assert 9.99 < per_param("bfloat16", False) < 10.01
    with pytest.raises(ValueError, match="engine.split_masters: true .* no float32 masters to split"):
        per_param("bfloat16", False, SPLIT)  # asked for where it can do nothing: refused, not ignored
    # the fixed part: the optimizer's scratch for a split tile's chunk (docs/host-store.md), only where split
    from megatrain.optim import SCRATCH_BYTES
    assert SCRATCH_BYTES == 1 << 27
    for master, engine, scratch in (("float32", SPLIT, SCRATCH_BYTES), ("float32", None, 0), ("bfloat16", None, 0)):
        assert plan(arch, settings(arch, engine, master=master)).detail["optimizer_scratch"] == scratch


def test_auto_splits_masters_only_when_the_host_needs_it():
    """engine.split_masters auto: whole masters (14 B/param, the faster CPU update) while that plan
    fits the stated host memory (engine.host_memory_gb); split (12 B/param) when only that one fits;
    where neither does at 4 gradient slabs, the same choice at 2 (auto slabs only); whole again
    when neither fits even so (the refusal then names what splitting would save). true and false
    hold whatever the host; float32 compute or bf16 masters have nothing to split (true refused)."""
    from megatrain.memory import DoesNotFit, admit
    from megatrain.resolve import host_available_bytes
    GiB = 2**30
    arch = shape_of("qwen2.5-7b")
    # the plans the choice weighs: with 4 gradient slabs (auto's slabs come after it)
    whole = plan(arch, settings(arch, EngineConfig(split_masters=False, grad_slabs=4))).host_bytes
    split = plan(arch, settings(arch, replace(SPLIT, grad_slabs=4))).host_bytes
    assert whole - split > 14 * 2**30  # 2 bytes for each of 7.6 B parameters, less the scratch
    split2 = plan(arch, settings(arch, replace(SPLIT, grad_slabs=2))).host_bytes  # 2 slabs fewer: a layer's
    assert 1.5 * GiB < split - split2 < 2 * GiB                                  # float32 gradient each
    def auto(gib, engine=None, **kw):
        cfg = replace(engine or EngineConfig(), host_memory_gb=gib)
        machine = Machine(False, None, host_available_bytes(cfg.host_memory_gb))
        s = resolve(replace(cfg, master_dtype=kw.get("master", "float32"), compute_dtype=kw.get("compute", "bfloat16")),
                    DataConfig(seq_len=16384), OptimConfig(max_grad_norm=None), arch, machine)
        return s, machine
    for gib, splits, slabs in ((whole / GiB, False, 4), (whole / GiB + 1, False, 4), (whole / GiB - 0.01, True, 8),
                               (split / GiB, True, 4), (split / GiB - 0.01, True, 2), (split2 / GiB, True, 2),
                               (split2 / GiB - 0.01, False, 2)):
        s, machine = auto(gib)
        assert (s.split_masters, s.grad_slabs) == (splits, slabs), gib
        p = plan(arch, s)
        assert 11.99 < p.detail["store"] / arch.total_params() - 2 * (not splits) < 12.01
        if s.split_masters or gib >= whole / GiB:
            admit(p, machine.host_available, None)
    # 4 slabs stated: split at 4 or not at all
    assert not auto(split / GiB - 0.01, EngineConfig(grad_slabs=4))[0].split_masters
    # neither fits: refused with the 14-byte plan, naming what splitting saves
    s, machine = auto(split2 / GiB - 0.01)
    with pytest.raises(DoesNotFit, match=r"engine.split_masters=true \(saves 1\d\.\d GiB: float32 masters in 12 bytes"):
        admit(plan(arch, s), machine.host_available, None)
    # turned off where it would have fit: refused, naming it
    s, machine = auto(split / GiB, EngineConfig(split_masters=False))
    assert not s.split_masters
    with pytest.raises(DoesNotFit, match=r"engine.split_masters=true \(which makes it fit"):
        admit(plan(arch, s), machine.host_available, None)
    assert auto(4096, SPLIT)[0].split_masters  # forced, with the host to spare
    for kw in ({"compute": "float32"}, {"master": "bfloat16"}):  # the master is its own shadow: nothing to split
        s, machine = auto(split / GiB, None, **kw)
        assert not s.split_masters and plan(arch, s).split_saves == 0 and plan(arch, s).detail["optimizer_scratch"] == 0
        with pytest.raises(ValueError, match="engine.split_masters: true holds float32 masters"):
            auto(split / GiB, SPLIT, **kw)  # asked for where it can do nothing: refused, not ignored
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"
    assert [load_config(tiny, [f"engine.split_masters={v}"]).engine.split_masters for v in ("true", "false", "auto")] \
        == [True, False, "auto"]
    with pytest.raises(ValueError, match="engine.split_masters must be true or false or 'auto', not 'yes please'"):
        load_config(tiny, ["engine.split_masters=yes please"])


def test_device_tiles_move_bytes_from_host_to_device():
    """Device tiles leave the host store (14 B/param there) for 12 B/param on the device; a count
    beyond the embedding and the layers is refused by name."""
    arch = shape_of("qwen2.5-7b")
    base = plan(arch, settings(arch, microbatches=4))
    moved = plan(arch, settings(arch, EngineConfig(device_tiles=3), microbatches=4))
    n = arch.vocab * arch.hidden + 2 * Layout.of(arch.layer_specs).numel  # embedding and layers 0, 1
    assert moved.detail["device.device_tiles"] == 12 * n
    assert 14 * n <= base.detail["store"] - moved.detail["store"] <= 14 * n + 3 * 4 * PAGE
    with pytest.raises(ValueError, match="engine.device_tiles must be between 0 and 29"):
        settings(arch, EngineConfig(device_tiles=30))
    tiny = shape_of("tiny-llama")
    store = HostStore(tiny, settings(tiny, EngineConfig(device_tiles=2), compute="float32", clipping=True),
                      torch.device("cpu"))
    assert [t.on_device for t in store.tiles] == [True, True, False, False, False]
    assert store.embed.shadow is None and store.embed.grad is None and store.layers[1].grad is not None


def test_adamw_in_pieces_equals_torch_adamw(monkeypatch):
    """A tile updated range by range, in small chunks, with decayed and undecayed parts, equals
    torch.optim.AdamW on the same parameters."""
    from megatrain import optim
    from megatrain.shapes import ParamSpec
    monkeypatch.setattr(optim, "CHUNK", 100)
    specs = [ParamSpec("w", (30, 20)), ParamSpec("norm", (70,))]
    tile = Tile("t", Layout.of(specs), torch.float32, torch.float32, pinned=False, grad=False)
    gen = torch.Generator().manual_seed(0)
    tile.master.copy_(torch.randn(tile.layout.numel, generator=gen))
    tile.exp_avg.zero_()
    tile.exp_avg_sq.zero_()
    ref = [v.clone().requires_grad_() for v in tile.master_views()]
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=1e-2, betas=cfg.betas, eps=cfg.eps)
    for step in range(1, 4):
        grad = torch.randn(tile.layout.numel, generator=gen)
        for r, view in zip(ref, tile.layout.views(grad)):
            r.grad = view.clone()
        opt.step()
        for lo, hi in ((0, 250), (250, 640), (640, tile.layout.numel)):  # pieces cut across both parameters
            optim.adamw(tile, lo, hi, grad[lo:hi].clone(), step, 1e-2, cfg, 1.0)
    for r, view in zip(ref, tile.master_views()):
        torch.testing.assert_close(view, r.detach(), rtol=1e-6, atol=1e-7)


def test_timeline_breakdown_and_trace(tmp_path):
    from megatrain import timeline as tl
    assert tl._union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert tl._complement([(1, 2), (3, 4)], 0, 5) == [(0, 1), (2, 3), (4, 5)]
    assert tl._intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    # compute busy (a gradient reduction at 2.9-3 among it) but for a wait on weights (1-1.2), a gap
    # with the host blocked on the optimizer for part of it (2-2.5, blocked 2.1-2.3) and the step's
    # tail (3-3.5): 0.8 s idle unattributed
    t = tl.Timeline(type("CPU", (), {"is_cuda": False})(), enabled=True)
    t.begin_step()
    for track, kind, start, end in ((tl.Track.COMPUTE, tl.Kind.FORWARD, 0.0, 1.0), (tl.Track.COMPUTE, tl.Kind.WAIT_WEIGHTS, 1.0, 1.2),
                                    (tl.Track.COMPUTE, tl.Kind.BACKWARD, 1.2, 2.0), (tl.Track.HOST, tl.Kind.WAIT_OPTIMIZER, 2.1, 2.3),
                                    (tl.Track.COMPUTE, tl.Kind.BACKWARD, 2.5, 2.9), (tl.Track.COMPUTE, tl.Kind.REDUCE, 2.9, 3.0),
                                    # the main thread issuing ops: one around the blocked wait, one in the tail
                                    (tl.Track.ISSUE, tl.Kind.ISSUE, 1.9, 2.4), (tl.Track.ISSUE, tl.Kind.ISSUE, 3.2, 3.3),
                                    # the optimizer's thread: one update across the step's end, one after it
                                    (tl.Track.OPTIMIZER, tl.Kind.UPDATE, 3.4, 3.7), (tl.Track.OPTIMIZER, tl.Kind.UPDATE, 3.6, 3.8)):
        t._add(track, kind, "", start, end)
    t._step_end = 3.5
    got = t.summary()
    assert got["optimizer_busy_s"] == pytest.approx(0.1)  # within the step only; none negative
    ran = [e["dur"] for e in t.chrome_trace()["traceEvents"] if e.get("cat") == "update"]
    assert ran == pytest.approx([0.3e6, 0.2e6])  # the trace shows both as they ran
    assert (got["wait_weights_s"], got["optimizer_exposed_s"]) == pytest.approx((0.2, 0.2))
    assert got["idle_unattributed_s"] == pytest.approx(0.8) and got["gpu_busy_s"] == pytest.approx(2.3)
    assert got["reduce_s"] == pytest.approx(0.1)  # the gradient's reduction among ranks: busy, and apart
    # idle and issuing, outside the wait: 2.0-2.1, 2.3-2.4 and 3.2-3.3
    assert got["idle_while_issuing_s"] == pytest.approx(0.3)
    cfg = load_config(Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml", ["steps=2", "data.grad_accum=2"])
    trainer = Trainer(cfg)
    try:
        for _ in range(2):
            m = trainer.train_step(trainer.next_microbatches())
        e = m["exposed"]
        assert 0 < e["gpu_busy_frac"] <= 1 and e["optimizer_busy_s"] > 0 and e["h2d_busy_s"] >= 0
        trainer.write_trace(tmp_path / "trace.json")
    finally:
        trainer.close()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    layers = trainer.shape.num_layers
    assert {f"forward L{layers - 1}", "head", "recompute L0", "backward L0", "load layer.0"} <= names
    issued = {e["name"] for e in events if e.get("cat") == "issue"}  # every op, as the main thread issued it
    assert {"issue Embed", f"issue Forward L{layers - 1}", "issue Head", "issue Recompute L0", "issue Backward L0"} <= issued
    updates = {e["name"] for e in events if e.get("cat") == "update"}
    assert any(n.startswith("update layer.0 [") for n in updates)  # the optimizer's update of layer 0


def test_timeline_step_holds_only_its_own_spans():
    """The optimizer's thread ends spans all the time, across step boundaries: a span that ended
    before a step began (the last step's, let in late) or the part after it ended is not the step's,
    so the timeline's step is never longer than the step. A span timed against the wrong step's
    origin makes a 0.2 ms step as long as the 20 ms step before it, or longer."""
    from megatrain import timeline as tl
    t = tl.Timeline(type("CPU", (), {"is_cuda": False})(), enabled=True)
    t.begin_step()
    stop = threading.Event()

    def optimizer():
        while not stop.is_set():
            with t.host(tl.Track.OPTIMIZER, tl.Kind.UPDATE, "tile"):
                pass
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches everywhere, inside a span's recording too
    worker = threading.Thread(target=optimizer)
    worker.start()
    long = []
    try:
        for i in range(60):  # a long step, then a short one
            start = time.perf_counter()  # the wall holds the step whole
            t.begin_step()
            time.sleep(0.02 if i % 2 else 0.0)
            t.end_step()
            wall = time.perf_counter() - start
            if (got := t.summary()["step_s"]) > wall + 0.005:
                long.append((i, got, wall))
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(interval)
    assert not long, long[:3]


def test_chunked_mlp_equals_the_whole_mlp():
    """Forward and every gradient of the chunked MLP equal the unchunked module's (float32, a chunk
    that does not divide the tokens); an MLP of another kind is refused by name."""
    from megatrain.chunked_mlp import chunk_tokens
    from transformers.models.llama.modeling_llama import LlamaMLP
    cfg = load_hf_config(ModelConfig(preset="tiny-llama"))
    torch.manual_seed(0)
    whole, chunked = LlamaMLP(cfg), LlamaMLP(cfg)
    chunked.load_state_dict(whole.state_dict())
    chunk_tokens(chunked, 7, cfg.hidden_act)
    x = torch.randn(2, 19, cfg.hidden_size)
    dy = torch.randn(2, 19, cfg.hidden_size)
    outs = []
    for mlp in (whole, chunked):
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        grads = torch.autograd.grad(y, [xi, *mlp.parameters()], dy)
        outs.append([y.detach(), *grads])
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not a bias-free SiLU-gated MLP"):
        chunk_tokens(LlamaMLP(cfg), 7, "gelu")


def test_memory_plan_bounds_the_mlp_by_its_chunk_and_refuses_with_numbers():
    """At 512K tokens of the 7B shape the whole MLP's activations (four tokens x FFN tensors per
    layer) are most of a layer's graph; chunked, only one chunk's count. A plan over the device or the
    host is refused with its numbers and the settings to change."""
    from megatrain.memory import DoesNotFit, admit
    arch = shape_of("qwen2.5-7b", max_position_embeddings=524288)
    def acts(chunk):
        cfg = EngineConfig(checkpoint_every=1, offload_checkpoints=True, mlp_chunk_tokens=chunk)
        return plan(arch, settings(arch, cfg, tokens=524288))
    whole, chunked = acts(None), acts(16384)
    ffn = arch.ffn
    assert whole.detail["device.block_activations"] - chunked.detail["device.block_activations"] == \
        (524288 - 16384) * 4 * ffn * 2
    with pytest.raises(DoesNotFit, match=r"device memory: needs 1\d\d\.\d GiB, 80.0 GiB available.*mlp_chunk_tokens") as e:
        admit(whole, host_available=2**50, device_available=80 * 2**30)
    assert e.value.memory == "device" and e.value.shortages[0].needed_bytes == whole.device_bytes
    admit(chunked, host_available=2**50, device_available=80 * 2**30)
    # over the host: the store and the gradient slabs named, each slab one layer's float32 gradient
    layer_gib = Layout.of(arch.layer_specs).numel * 4 / 2**30
    assert chunked.detail["grad_slabs"] == 8 * layer_gib * 2**30  # auto, on an unbounded host
    with pytest.raises(ValueError, match=rf"host memory: .*gradient slabs {8 * layer_gib:.1f} GiB; fewer engine.grad_slabs"):
        admit(chunked, host_available=chunked.detail["store"], device_available=None)


def test_auto_mlp_chunk_only_when_the_plan_needs_it():
    """auto keeps the whole MLP while the plan fits the device; past it, the largest chunk that fits."""
    from megatrain.resolve import MLP_CHUNKS
    arch = shape_of("qwen2.5-7b", max_position_embeddings=524288)
    cfg = EngineConfig(checkpoint_every=1, offload_checkpoints=True)
    def choose(tokens, free):
        return settings(arch, cfg, tokens=tokens, device_free=free).mlp_chunk_tokens
    assert choose(32768, 80 * 2**30) is None and choose(524288, None) is None
    chunk = choose(524288, 80 * 2**30)
    assert chunk in MLP_CHUNKS
    fits = [plan(arch, settings(arch, replace(cfg, mlp_chunk_tokens=c), tokens=524288)).device_bytes <= 80 * 2**30
            for c in MLP_CHUNKS]
    assert fits[MLP_CHUNKS.index(chunk)] and not any(fits[: MLP_CHUNKS.index(chunk)])
    with pytest.raises(ValueError, match="engine.mlp_chunk_tokens must be an integer or 'auto' or null, not 'big'"):
        EngineConfig(mlp_chunk_tokens="big")


def test_grad_slabs_auto_takes_eight_where_the_host_holds_them():
    """auto: 8 slabs where the plan with 8 fits the host, else 4, else 2 (where admission may then
    refuse, naming them); a number given is kept; a negative one is refused by name."""
    arch = shape_of("qwen2.5-7b")
    host = {n: plan(arch, settings(arch, EngineConfig(grad_slabs=n))).host_bytes for n in (8, 4, 2)}
    assert host[8] - host[4] == 4 * Layout.of(arch.layer_specs).numel * 4  # a layer's float32 gradient each
    assert settings(arch).grad_slabs == 8 and settings(arch, host=host[8]).grad_slabs == 8
    assert settings(arch, host=host[8] - 1).grad_slabs == 4
    # short of 4 with whole masters: split ones (decided at 4 slabs) leave room for 8
    short = settings(arch, host=host[4] - 1)
    assert short.split_masters and short.grad_slabs == 8
    whole = EngineConfig(split_masters=False)
    assert settings(arch, whole, host=host[4] - 1).grad_slabs == 2
    assert settings(arch, whole, host=host[2] - 1).grad_slabs == 2
    assert settings(arch, EngineConfig(grad_slabs=3), host=host[4]).grad_slabs == 3
    with pytest.raises(ValueError, match="engine.grad_slabs must be an integer >= 0 or auto, not -1"):
        EngineConfig(grad_slabs=-1)


def test_device_tiles_auto_takes_the_room_the_plan_leaves():
    """auto: the most tiles (in forward order) the device holds beside the rest of the plan with a
    workspace to spare; none without a bound; the layers kept from recompute get what is left."""
    from megatrain.memory import DEVICE_WORKSPACE
    arch = shape_of("qwen2.5-3b")
    base = EngineConfig(checkpoint_every=1, device_tiles="auto", no_recompute_layers="auto")
    def device(n):
        return plan(arch, settings(arch, replace(base, device_tiles=n, no_recompute_layers=0))).device_bytes
    def choose(free):
        return settings(arch, base, device_free=free).device_tiles
    assert choose(None) == 0 and choose(device(0)) == 0 and choose(10**15) == arch.num_layers + 1
    n = choose(40 * 2**30)
    assert 0 < n < arch.num_layers + 1
    assert device(n) + DEVICE_WORKSPACE <= 40 * 2**30 < device(n + 1) + DEVICE_WORKSPACE
    kept = settings(arch, base, device_free=40 * 2**30).no_recompute_layers  # after n tiles
    assert kept < settings(arch, replace(base, device_tiles=0), device_free=40 * 2**30).no_recompute_layers
    with pytest.raises(ValueError, match="engine.device_tiles must be an integer or 'auto', not 'many'"):
        EngineConfig(device_tiles="many")


@pytest.mark.parametrize("preset, kept", [("phi-3-mini", 10), ("gemma-2-9b", 10)])
def test_a_family_that_keeps_more_is_planned_with_its_measure(preset, kept):
    """Phi-3's fused qkv and Gemma's extra norms keep more of a layer's activations than the Llama
    layout (memory.FAMILY_ATTN_KEPT): a layer kept from recompute is planned with that measure."""
    from megatrain.memory import ATTN_KEPT, FAMILY_ATTN_KEPT
    arch = shape_of(preset, attn_logit_softcapping=None) if preset.startswith("gemma") else shape_of(preset)
    assert arch.config._attn_implementation == "sdpa" and FAMILY_ATTN_KEPT[arch.family] == kept > ATTN_KEPT
    base = EngineConfig(checkpoint_every=1, grad_slabs=12)
    def device(n):
        return plan(arch, settings(arch, replace(base, no_recompute_layers=n), tokens=4096)).device_bytes
    assert device(1) - device(0) == 4096 * (kept * arch.hidden + 4 * arch.ffn) * 2 - 4096 * arch.hidden * 2


def test_no_recompute_layers_are_counted_and_chosen_by_the_plan():
    """Each layer kept from recompute holds its graph for every micro-batch of the step; auto keeps as
    many of the last layers as the device holds with a workspace to spare, none without a bound."""
    from megatrain.memory import ATTN_KEPT, DEVICE_WORKSPACE
    arch = shape_of("qwen2.5-3b")
    base = EngineConfig(checkpoint_every=1, device_tiles=20, grad_slabs=12)
    def device(n, tokens=16384, micro=1):
        return plan(arch, settings(arch, replace(base, no_recompute_layers=n), tokens=tokens,
                                   microbatches=micro)).device_bytes
    h, ffn = arch.hidden, arch.ffn
    per_layer = 16384 * (ATTN_KEPT * h + 4 * ffn) * 2
    # a kept layer holds its graph and no longer needs a checkpoint
    assert device(4) - device(0) == 4 * per_layer - 4 * 16384 * h * 2
    assert device(4, micro=2) - device(0, micro=2) == 2 * (4 * per_layer - 4 * 16384 * h * 2)
    def choose(free):
        return settings(arch, replace(base, no_recompute_layers="auto"), device_free=free).no_recompute_layers
    assert choose(None) == 0
    n = choose(80 * 2**30)
    assert 0 < n < arch.num_layers
    assert device(n) + DEVICE_WORKSPACE <= 80 * 2**30 < device(n + 1) + DEVICE_WORKSPACE
    assert choose(10**15) == arch.num_layers and choose(device(0)) == 0
    with pytest.raises(ValueError, match="at most the model's 36 layers"):
        device(37)
    with pytest.raises(ValueError, match="integer >= 0 or auto"):
        EngineConfig(no_recompute_layers=-1)


def test_a_block_holds_no_more_layers_than_the_model_recomputes():
    """A block has at most the recomputed layers: a 2-layer model at K = 4 (the width experiment's
    shape, where the plan once counted 4 layers) plans a 2-layer block's graphs and gradients; a
    model whose every layer is kept plans no recomputed block; a deep model's blocks hold K."""
    def device(layers, k, kept=0):
        arch = shape_of("qwen2.5-7b", num_hidden_layers=layers)
        return plan(arch, settings(arch, EngineConfig(checkpoint_every=k, no_recompute_layers=kept))).detail
    assert device(2, 4)["device.block_activations"] == device(2, 2)["device.block_activations"] > 0
    assert device(2, 4)["device.grad_accumulators"] == device(2, 2)["device.grad_accumulators"]
    assert device(2, 4)["device.grad_accumulators"] < device(3, 4)["device.grad_accumulators"]
    assert device(2, 2, kept=2)["device.block_activations"] == 0
    assert device(8, 4)["device.block_activations"] == 2 * device(8, 2)["device.block_activations"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 7])
def test_lean_norm_is_the_library_norm(monkeypatch, family, dtype, chunk):
    """The decoder layers' RMSNorm keeping only its input: the same output and gradients as the
    library's module, to the bit (the same ops, run again in the backward). Over token chunks (30
    tokens in chunks of 7) rows are independent, so the output and the input gradient stay exact;
    the weight gradient sums the chunks' (each rounded to the weight's dtype) in float32: a few bf16
    roundings apart, where a chunk lost would be whole units off."""
    import megatrain.lean_norm as lean_norm
    from megatrain.shapes import FAMILIES, modeling
    if chunk:
        monkeypatch.setattr(lean_norm, "CHUNK", chunk)
    cls = getattr(modeling(family), f"{FAMILIES[family]}RMSNorm")
    scale = "one_plus" if family.startswith("gemma") else "input"  # Gemma's (1 + weight) in float32
    (y, dx, dw), (lean_y, lean_dx, lean_dw) = library_and_lean(cls, dtype, scale=scale)
    assert torch.equal(y, lean_y) and torch.equal(dx, lean_dx)
    tol = 0 if not chunk else 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(lean_dw, dw, rtol=tol, atol=tol)


def library_and_lean(cls, dtype, **lean):
    """A library RMSNorm and its copy made lean (`lean`: make_lean's options), each run forward and
    backward on the same input and output gradient: their (output, input gradient, weight gradient)."""
    import megatrain.lean_norm as lean_norm
    norms = cls(64, eps=1e-6).to(dtype), cls(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norms[0].weight.normal_(1.0, 0.3)
        norms[1].weight.copy_(norms[0].weight)
    lean_norm.make_lean(norms[1], **lean)
    x = torch.randn(3, 10, 64, dtype=dtype)
    dy = torch.randn_like(x)
    out = []
    for norm in norms:
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(dy)
        out.append((y.detach(), xi.grad, norm.weight.grad))
    return out


@pytest.mark.parametrize("scale", ["input", "float32", "one_plus"], ids=["qwen2", "gpt-oss-scale", "gemma2-one-plus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 7])
def test_compiled_norm_is_the_library_norm_to_rounding(monkeypatch, scale, dtype, chunk):
    """engine.norm_kernel: compiled, the forward and the written-out backward built by
    torch.compile: the library's output and gradients to float32 rounding, and in bf16 to about one
    bf16 rounding (its products stay in float32 where the library's round to bf16)."""
    import megatrain.lean_norm as lean_norm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    if chunk:
        monkeypatch.setattr(lean_norm, "CHUNK", chunk)
    cls = {"input": Qwen2RMSNorm, "float32": GptOssRMSNorm, "one_plus": Gemma2RMSNorm}[scale]
    library, fused = library_and_lean(cls, dtype, scale=scale, compiled=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(fused, library):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_compiled_kernels_are_built_once_whatever_their_callers_shapes():
    """Dynamo builds a function at most recompile_limit times a process and then runs its library
    ops instead (kernel_build): the norm's and the MLP's kernels see inputs of every rank, with gradients or
    without, in one form, so these twelve calls add one build each (before: six a forward, three a
    backward)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    import megatrain.lean_norm as lean_norm
    from megatrain import swiglu
    kernels = (lean_norm._rms_norm, lean_norm._backward, swiglu._product, swiglu._grads)
    before = [len(entries(k.__code__)) for k in kernels]
    weight = torch.ones(16, requires_grad=True)
    for shape in ((2, 3, 16), (2, 3, 4, 16), (5, 16)):
        for grad in (False, True):
            x, up = torch.randn(shape, requires_grad=grad), torch.randn(shape, requires_grad=grad)
            y = lean_norm._LeanRMSNorm.apply(x, weight, 0.123, False, True) + swiglu.swiglu(x, up)  # a new eps
            if grad:
                y.sum().backward()
    built = [len(entries(k.__code__)) - b for k, b in zip(kernels, before)]
    assert max(built) <= 1, built


def test_norm_kernels_are_built_once_a_row_width():
    """A norm kernel's reduction is configured at its build for the width it was built at (lean_norm):
    Qwen3's head norms (128 wide) beside its hidden-size norms get a kernel of their own, and more
    rows at a width build nothing. The process's recompile limit leaves room for every model's widths."""
    import torch._dynamo.config as dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    import megatrain.kernel_build as kernel_build
    import megatrain.lean_norm as lean_norm
    kernels = (lean_norm._rms_norm, lean_norm._backward)
    before = [len(entries(k.__code__)) for k in kernels]
    for rows, width in ((6, 24), (11, 24), (6, 8), (40, 8), (3, 24)):
        x = torch.randn(rows, width, requires_grad=True)
        lean_norm._LeanRMSNorm.apply(x, torch.ones(width, requires_grad=True), 0.321, False, True).sum().backward()
    assert [len(entries(k.__code__)) - b for k, b in zip(kernels, before)] == [2, 2]
    assert dynamo.recompile_limit >= kernel_build.RECOMPILE_LIMIT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_swiglu_is_the_library_product_to_rounding(dtype):
    """engine.mlp_kernel: compiled, silu(gate) * up and its written-out backward built by
    torch.compile: the library's values and gradients to float32 rounding, and in bf16 to about one
    bf16 rounding (silu(gate) is not rounded to bf16 before the product)."""
    import torch.nn.functional as F
    from megatrain.swiglu import swiglu
    gate, up = torch.randn(3, 10, 96, dtype=dtype), torch.randn(3, 10, 96, dtype=dtype)
    gates = [gate.clone().requires_grad_() for _ in range(2)]
    ups = [up.clone().requires_grad_() for _ in range(2)]
    ys = [F.silu(gates[0]) * ups[0], swiglu(gates[1], ups[1])]
    dy = torch.randn_like(ys[0])
    for y in ys:
        y.backward(dy)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    for got, want in ((ys[1], ys[0]), (gates[1].grad, gates[0].grad), (ups[1].grad, ups[0].grad)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_is_the_library_loss_to_rounding(dtype):
    """engine.loss_kernel: compiled, the summed cross-entropy and the gradient of (loss * scale)
    with respect to the logits from one torch.compile'd function: the library's (float32 logits,
    F.cross_entropy and autograd) to float32 rounding, ignored targets and a chunk without any
    target included; the gradient in the logits' dtype."""
    import torch.nn.functional as F
    from megatrain.loss import IGNORE, _compiled_cross_entropy
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 300, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 300, (23,), generator=gen)
    targets[::4] = IGNORE
    for t in (targets, torch.full_like(targets, IGNORE)):
        z = logits.clone().requires_grad_()
        want = F.cross_entropy(z.float(), t, ignore_index=IGNORE, reduction="sum")
        (want * 0.3).backward()
        loss, grad = _compiled_cross_entropy(logits, t, torch.tensor(0.3))
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-5)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the gradient
        torch.testing.assert_close(grad, z.grad, rtol=tol, atol=tol * max(z.grad.abs().max().item(), 1e-3))
        assert not grad[t == IGNORE].any()


def test_compiled_mlp_keeps_one_ffn_tensor_less_and_the_plan_counts_it():
    """What the SiLU-gated MLP saves for its backward, through saved-tensor hooks: the library's
    keeps four tokens x FFN tensors (gate, silu(gate), up, the product: ModelShape.mlp_kept), the
    compiled product three (gate, up, the product); the memory plan's activations differ by one."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP
    from megatrain.unread_mlp import skip_unread_down
    config = Qwen2Config(hidden_size=32, intermediate_size=80, hidden_act="silu")
    x = torch.randn(2, 5, 32, requires_grad=True)
    counts = {}
    for compiled in (False, True):
        mlp = Qwen2MLP(config)
        skip_unread_down(mlp, compiled=compiled)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            mlp(x).sum().backward()
        counts[compiled] = saved.count(2 * 5 * 80)  # tokens x FFN (the down projection's input as 10 x 80)
    assert counts == {False: 4, True: 3}
    shape = shape_of("qwen2.5-7b")
    assert shape.mlp_kept == 4 * shape.ffn
    s = resolve(EngineConfig(device="cpu", no_recompute_layers=2), DataConfig(seq_len=4096, batch_size=2), OptimConfig(),
                shape, Machine(False, None, 1 << 50))
    eager, fused = (plan(shape, replace(s, mlp_kernel=k)).detail for k in ("eager", "compiled"))
    ffn_tensor = s.tokens * shape.ffn * 4  # float32 compute on the CPU
    assert eager["device.block_activations"] - fused["device.block_activations"] == s.checkpoint_every * ffn_tensor
    assert eager["device.kept_graphs"] - fused["device.kept_graphs"] == 2 * ffn_tensor


def test_layer_kernels_auto_compile_on_a_gpu_only():
    """engine.norm_kernel, engine.mlp_kernel and engine.loss_kernel `auto`: compiled on a GPU (the
    MLP's only where it is SiLU-gated), eager on the CPU; engine.experts_kernel `auto`: lean on a GPU
    where the model has experts, the library's elsewhere, lean refused for a dense model; a mixture
    of experts' compiled MLP kernel is its gate, within the lean experts only; a stated choice stands."""
    data = DataConfig(seq_len=4096, batch_size=2)
    chosen = {}
    auto = EngineConfig()
    for preset, cuda, engine in (("qwen2.5-7b", True, auto), ("qwen2.5-7b", False, auto),
                                 ("gpt-oss-20b", True, auto),
                                 ("qwen2.5-7b", True, EngineConfig(norm_kernel="eager", mlp_kernel="eager")),
                                 ("qwen2.5-7b", True, EngineConfig(norm_kernel="compiled"))):
        s = resolve(engine, data, OptimConfig(), shape_of(preset), Machine(cuda, None, 1 << 50, int(cuda)))
        chosen[preset, cuda, engine.norm_kernel] = (s.norm_kernel, s.mlp_kernel, s.loss_kernel, s.experts_kernel)
    assert chosen == {("qwen2.5-7b", True, "auto"): ("compiled", "compiled", "compiled", "library"),
                      ("qwen2.5-7b", False, "auto"): ("eager", "eager", "eager", "library"),
                      ("gpt-oss-20b", True, "auto"): ("compiled", "compiled", "compiled", "lean"),
                      ("qwen2.5-7b", True, "eager"): ("eager", "eager", "compiled", "library"),
                      ("qwen2.5-7b", True, "compiled"): ("compiled", "compiled", "compiled", "library")}
    gpu = Machine(True, None, 1 << 50, 1)
    s = resolve(EngineConfig(), data, OptimConfig(), shape_of("gpt-oss-20b"), Machine(False, None, 1 << 50, 0))
    assert (s.experts_kernel, s.mlp_kernel) == ("library", "eager")  # the CPU: the library's, as the reference trains
    s = resolve(EngineConfig(experts_kernel="library"), data, OptimConfig(), shape_of("qwen3-30b-a3b"), gpu)
    assert (s.experts_kernel, s.mlp_kernel) == ("library", "eager")  # the gate compiles within the lean experts
    with pytest.raises(ValueError, match="engine.experts_kernel: lean is for a mixture of experts"):
        resolve(EngineConfig(experts_kernel="lean"), data, OptimConfig(), shape_of("qwen2.5-7b"), gpu)
    with pytest.raises(ValueError, match="compiles a mixture of experts' gate within the lean experts .set engine"):
        resolve(EngineConfig(experts_kernel="library", mlp_kernel="compiled"), data, OptimConfig(),
                shape_of("gpt-oss-20b"), gpu)


def test_engine_kernels_build_in_this_process():
    """kernel_build.compiled: the function's own result, and inductor set to build in this process
    (compile_threads 1: no pool of compile workers; the GPU test counts the processes)."""
    import torch._inductor.config as inductor
    from megatrain.kernel_build import compiled
    x = torch.randn(8, 16)
    with inductor.patch(compile_threads=4):
        assert torch.equal(compiled(lambda t: t * 2 + 1)(x), x * 2 + 1)
        assert inductor.compile_threads == 1


def test_compiled_mlp_kernel_is_refused_for_other_mlps(tmp_path):
    """A dense MLP that is not SiLU-gated, and a mixture of experts' gate outside the lean experts."""
    args = DataConfig(seq_len=16, batch_size=1), OptimConfig()
    with pytest.raises(ValueError, match="engine.mlp_kernel: compiled is for the bias-free SiLU-gated MLP; this qwen2"):
        resolve(EngineConfig(device="cpu", mlp_kernel="compiled"), *args, shape_of("tiny-qwen2", hidden_act="gelu"),
                Machine(False, None, 1 << 40))
    with pytest.raises(ValueError, match="compiles a mixture of experts' gate within the lean experts .set engine"):
        resolve(EngineConfig(device="cpu", mlp_kernel="compiled"), *args, shape_of("tiny-gpt-oss"), Machine(False, None, 1 << 40))
    with pytest.raises(ValueError, match="this qwen3_moe model's activation has no compiled gate"):
        resolve(EngineConfig(device="cpu", mlp_kernel="compiled", experts_kernel="lean"), *args,
                shape_of("tiny-qwen3-moe", hidden_act="gelu"), Machine(False, None, 1 << 40))


def test_memory_plan_counts_pinned_buffers_at_their_allocated_size():
    """torch's pinned allocator hands out powers of two: with a GPU the plan counts the slabs,
    staging and offloaded checkpoints at that size (on the H100 this brought the plan from 2-6 GiB
    under every measured host peak to 0.3-0.5 GiB over it); the store's shadows are registered at
    their exact size (store.Blocks), so the store's bytes do not depend on pinning."""
    from megatrain.store import pinned_bytes
    assert pinned_bytes(466_000_000, True) == 512 * 2**20 and pinned_bytes(466_000_000, False) == 466_000_000
    assert pinned_bytes(2**30, True) == 2**30 and pinned_bytes(0, True) == 0
    arch = shape_of("qwen2.5-7b")
    cfg = EngineConfig(checkpoint_every=1, offload_checkpoints=True, grad_slabs=4)
    def host(pinned):
        return plan(arch, settings(arch, cfg, tokens=65536, pinned=pinned)).detail
    pageable, pinned = host(False), host(True)
    layer, h = Layout.of(arch.layer_specs).numel, arch.hidden
    assert pinned["grad_slabs"] == 4 * pinned_bytes(layer * 4, True) > pageable["grad_slabs"]
    assert pinned["checkpoint_offload"] == 28 * 512 * 2**20 and pageable["checkpoint_offload"] == 28 * 65536 * h * 2
    assert pinned["store"] == pageable["store"]


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


def test_flops_count_fused_projections_as_the_ones_they_fuse():
    """Phi-3's qkv_proj and gate_up_proj are the q, k, v and gate, up matrices side by side: N counts
    them whole, 6 N + 12 L h s per token; an MLP that is not the separate gated one keeps its down
    projection in the recompute, so the hardware FLOPs add every recomputed layer whole."""
    from megatrain.metrics import model_flops
    from megatrain.schedule import Schedule
    s = shape_of("tiny-phi3")  # hidden 64, 4 heads of 16 (2 kv), FFN 128, vocab 256, 3 layers, tied
    h, kv, f, v = 64, 32, 128, 256
    layer = (h + 2 * kv) * h + h * h + 2 * f * h + f * h  # qkv, o, gate-up, down
    assert s.layer_matmul_params() == layer and s.matmul_params() == 3 * layer + v * h
    lengths = [16, 9]
    model = model_flops(s.matmul_params(), s.attention(), lengths)
    assert model == sum(n * (6 * s.matmul_params() + 12 * 3 * h * n) for n in lengths)
    again = sum(n * (2 * layer + 4 * h * n) for n in lengths)
    assert Schedule(3, 1, 0, 1).hardware_flops(s, None, lengths) == model + 3 * again


def test_flops_of_gemma_count_each_layers_window_and_the_tied_head_once():
    """Gemma 3: q, k, v, o and the GeGLU's three matrices a layer (its q and k norms, soft-capping and
    embedding scale are no matmul), the tied head once; sliding layers' attention counted against
    their window (6), the full layer's against the sequence."""
    from megatrain.metrics import model_flops
    s = shape_of("tiny-gemma3")  # hidden 64, 4 heads of 16 (2 kv), FFN 128, vocab 256, layers sliding-full-sliding
    h, kv, f, v = 64, 32, 128, 256
    layer = 2 * h * h + 2 * kv * h + 3 * h * f
    assert s.layer_matmul_params() == layer and s.matmul_params() == 3 * layer + v * h
    assert s.attention() == [(64, 6), (64, None), (64, 6)]
    n = 16
    assert model_flops(s.matmul_params(), s.attention(), [n]) == n * (6 * s.matmul_params() + 12 * 64 * (6 + n + 6))


@pytest.mark.parametrize("preset, total, layers", [("phi-3-mini", 3.82e9, 32), ("gemma-2-9b", 9.24e9, 42)])
def test_dense_presets_have_the_published_shapes(preset, total, layers):
    """Parameters as the model cards state them: Phi-3-mini 3.8B, Gemma 2 9B 9.24B (tied); N, the
    FLOPs formula's matmul weights, is everything but the norms and, untied, the embedding."""
    s = shape_of(preset)
    assert s.num_layers == layers and s.total_params() == pytest.approx(total, rel=1e-3)
    norms = sum(p.numel for p in s.layer_specs if not p.matmul) * layers + s.hidden
    assert s.matmul_params() == s.total_params() - norms - (0 if s.tied else s.vocab * s.hidden)
    if s.family == "gemma2":  # 16 heads of 256 (not the hidden size 3584), sliding first
        assert s.attention()[:2] == [(4096, 4096), (4096, None)] and s.config._attn_implementation != "sdpa"
    else:
        assert s.attention()[0] == (3072, 2047)


def test_random_init_of_gemma_zeroes_its_norms():
    """Gemma's norms scale by (1 + weight): a preset's seeded init sets them zero, as the library's
    init does (one would double every norm's output), the final norm's too; matrices N(0, 0.02)."""
    from megatrain.config import load_config
    from megatrain.trainer import Trainer
    trainer = Trainer(load_config(base={"model": {"preset": "tiny-gemma3"}, "engine": {"device": "cpu"},
                                        "data": {"seq_len": 16, "batch_size": 1}, "steps": 1}))
    try:
        layer, head = (dict(zip((s.name for s in t.layout.specs), t.master_views()))
                       for t in (trainer.store.layers[1], trainer.store.head))
    finally:
        trainer.close()
    for name in ("input_layernorm.weight", "post_feedforward_layernorm.weight", "self_attn.q_norm.weight"):
        assert not layer[name].any(), name
    assert not head["norm.weight"].any()
    assert 0.01 < float(layer["mlp.up_proj.weight"].std()) < 0.03


def test_host_memory_is_taken_as_stated(monkeypatch):
    """A host whose MemTotal grows as memory is used reads far too little at start: the memory a run
    may use comes from engine.host_memory_gb, else MEGATRAIN_HOST_MEMORY_GB, else the OS."""
    from megatrain.resolve import HOST_MEMORY_ENV, host_available_bytes
    monkeypatch.delenv(HOST_MEMORY_ENV, raising=False)
    assert 0 < host_available_bytes() < 2**50
    monkeypatch.setenv(HOST_MEMORY_ENV, "256")
    assert host_available_bytes() == 256 * 2**30 and host_available_bytes(10) == 10 * 2**30
    for bad in ("lots", "0"):
        monkeypatch.setenv(HOST_MEMORY_ENV, bad)
        with pytest.raises(ValueError, match=HOST_MEMORY_ENV):
            host_available_bytes()


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    """A writer that fails half way leaves the previous file as it was and no temporary beside it."""
    from megatrain.io import atomic_file, write_text
    target = tmp_path / "table.csv"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            assert tmp.suffix == ".csv" and tmp.parent == tmp_path
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]
    write_text(target, "new\n")
    assert target.read_text() == "new\n"


def test_the_layer_ceiling_runs_before_and_after_steps():
    """Engine.layer_ceiling (the suite's `ceiling` option, the layer-kernel probe) times one layer's
    forward, recompute and backward whether or not a step has run: it opens its own timeline step."""
    cfg = load_config(base={"model": {"preset": "tiny-qwen2"}, "engine": {"device": "cpu"},
                            "data": {"source": "synthetic", "seq_len": 16, "batch_size": 2}, "steps": 1})
    trainer = Trainer(cfg)
    try:
        before = trainer.engine.layer_ceiling(2, 16, reps=1)
        trainer.train_step(random_batches(1, 1, 2, 16, trainer.shape.vocab, pad=False)[0])
        after = trainer.engine.layer_ceiling(2, 16, reps=1)
    finally:
        trainer.close()
    for row in (before, after):
        assert row["seconds"] > 0 and row["model_tflops"] > 0 and row["tokens"] == 32


def test_the_environment_names_the_tracked_files_that_differ_from_the_commit(monkeypatch):
    """A GPU point's copy of the tree can differ from its commit; the result says in which files."""
    import megatrain.metrics as metrics
    answers = {"status": " M megatrain/store.py\nM  README.md\n", "rev-parse": "ab" * 20}
    monkeypatch.setattr(metrics, "_git", lambda *args: answers[args[0]].strip())  # as _git gives them
    monkeypatch.delenv("MEGATRAIN_GIT_COMMIT", raising=False)
    env = metrics.environment()
    assert env["git_dirty"] and env["git_dirty_paths"] == ["megatrain/store.py", "README.md"]
    answers["status"] = ""
    env = metrics.environment()
    assert not env["git_dirty"] and env["git_dirty_paths"] == []
