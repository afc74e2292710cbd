"""The memory plan (megatrain/memory.py) and the settings megatrain/resolve.py decides by it: bytes
per parameter of the store, device tiles, pinned buffers, the MLP's chunk, gradient slabs, layers
kept from recompute, the layer kernels chosen per machine, the host memory as stated; refusals that
name the setting and the numbers."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import ROOT, settings, shape_of
from megatrain.config import DataConfig, EngineConfig, OptimConfig, load_config
from megatrain.memory import plan
from megatrain.resolve import Machine, resolve
from megatrain.store import PAGE, HostStore, Layout

SPLIT = EngineConfig(split_masters=True)
WHOLE = EngineConfig(split_masters=False)
EAGER = EngineConfig(optimizer_kernel="eager")  # the host update with which split masters' auto keeps them whole


def test_memory_plan_counts_bytes_per_parameter():
    arch = shape_of("qwen2.5-7b")
    def per_param(master, clipping, engine=None):
        p = plan(arch, settings(arch, engine, master=master, microbatches=4, clipping=clipping))
        return p.detail["store"] / n
    n = arch.total_params()
    assert 7.5e9 < n < 7.7e9
    assert 11.99 < per_param("float32", False, WHOLE) < 12.01  # fp32 master + 2 moments (a load casts on the device)
    assert 15.99 < per_param("float32", True, WHOLE) < 16.01  # + a float32 gradient waiting for the norm
    assert 11.99 < per_param("float32", False, SPLIT) < 12.01  # fp32 master as bf16 shadow + low halves
    assert 15.99 < per_param("float32", True, SPLIT) < 16.01
    assert 9.99 < per_param("bfloat16", False) < 10.01
    with pytest.raises(ValueError, match="engine.split_masters: true .* no float32 masters to split"):
        per_param("bfloat16", False, SPLIT)  # asked for where it can do nothing: refused, not ignored
    # the fixed part: the optimizer's scratch for a split tile's chunk (docs/host-store.md), only where split
    from megatrain.adamw import SCRATCH_BYTES
    assert SCRATCH_BYTES == 1 << 27
    for master, engine, scratch in (("float32", SPLIT, SCRATCH_BYTES), ("float32", WHOLE, 0), ("bfloat16", None, 0)):
        assert plan(arch, settings(arch, engine, master=master)).detail["optimizer_scratch"] == scratch


def test_auto_splits_masters_where_the_update_is_one_pass():
    """engine.split_masters auto: split wherever the host's compiled AdamW runs (a load then moves
    the bf16 shadow, half a whole master's bytes), whole with the eager update (torch's fused AdamW
    on the master itself, no passes around it), whatever the host: either holds 12 bytes a
    parameter, and a plan over the host is refused without naming the split. true and false hold
    whatever the host; float32 compute or bf16 masters have nothing to split (true refused)."""
    from megatrain.adamw import SCRATCH_BYTES
    from megatrain.memory import DoesNotFit, admit
    from megatrain.resolve import host_available_bytes
    GiB = 2**30
    arch = shape_of("qwen2.5-7b")
    whole = plan(arch, settings(arch, EngineConfig(split_masters=False, grad_slabs=4))).host_bytes
    split = plan(arch, settings(arch, replace(SPLIT, grad_slabs=4))).host_bytes
    assert 0 <= split - whole <= SCRATCH_BYTES + 2**20  # the eager update's scratch, and pages

    def auto(gib, engine=None, **kw):
        cfg = replace(engine or EAGER, host_memory_gb=gib, grad_slabs=4)
        machine = Machine(False, None, host_available_bytes(cfg.host_memory_gb))
        s = resolve(replace(cfg, master_dtype=kw.get("master", "float32"), compute_dtype=kw.get("compute", "bfloat16")),
                    DataConfig(seq_len=16384), OptimConfig(max_grad_norm=None), arch, machine)
        return s, machine
    for gib in (whole / GiB - 1, whole / GiB, 4096):
        assert not auto(gib)[0].split_masters, gib
        s = auto(gib, EngineConfig())[0]
        assert s.optimizer_kernel == "compiled" and s.split_masters, gib
        assert 11.99 < plan(arch, s).detail["store"] / arch.total_params() < 12.01
    s, machine = auto(whole / GiB - 1)
    with pytest.raises(DoesNotFit) as refused:
        admit(plan(arch, s), machine.host_available, None)
    assert "split_masters" not in str(refused.value)
    assert auto(4096, SPLIT)[0].split_masters and not auto(4096, replace(WHOLE, optimizer_kernel="compiled"))[0].split_masters
    for kw in ({"compute": "float32"}, {"master": "bfloat16"}):  # the master is what streams: nothing to split
        s, machine = auto(4096, None, **kw)
        assert not s.split_masters and plan(arch, s).detail["optimizer_scratch"] == 0
        with pytest.raises(ValueError, match="engine.split_masters: true holds float32 masters"):
            auto(4096, SPLIT, **kw)  # asked for where it can do nothing: refused, not ignored
    tiny = ROOT / "configs" / "tiny-cpu.yaml"
    assert [load_config(tiny, [f"engine.split_masters={v}"]).engine.split_masters for v in ("true", "false", "auto")] \
        == [True, False, "auto"]
    with pytest.raises(ValueError, match="engine.split_masters must be true or false or 'auto', not 'yes please'"):
        load_config(tiny, ["engine.split_masters=yes please"])


def test_device_tiles_move_bytes_from_host_to_device():
    """Device tiles leave the host store (12 B/param there with whole masters) for 12 B/param on the device; a count
    beyond the embedding and the layers is refused by name."""
    arch = shape_of("qwen2.5-7b")
    base = plan(arch, settings(arch, WHOLE, microbatches=4))
    moved = plan(arch, settings(arch, replace(WHOLE, device_tiles=3), microbatches=4))
    n = arch.vocab * arch.hidden + 2 * Layout.of(arch.layer_specs).numel  # embedding and layers 0, 1
    assert moved.detail["device.device_tiles"] == 12 * n
    assert 12 * n <= base.detail["store"] - moved.detail["store"] <= 12 * n + 3 * 3 * PAGE
    with pytest.raises(ValueError, match="engine.device_tiles must be between 0 and 29"):
        settings(arch, EngineConfig(device_tiles=30))
    tiny = shape_of("tiny-llama")
    store = HostStore(tiny, settings(tiny, EngineConfig(device_tiles=2), compute="float32", clipping=True),
                      torch.device("cpu"))
    assert [t.on_device for t in store.tiles] == [True, True, False, False, False]
    assert store.embed.shadow is None and store.embed.grad is None and store.layers[1].grad is not None


def test_memory_plan_counts_pinned_buffers_at_their_allocated_size():
    """torch's pinned allocator hands out powers of two: with a GPU the plan counts the slabs,
    staging and offloaded checkpoints at that size (on the H100 this brought the plan from 2-6 GiB
    under every measured host peak to 0.3-0.5 GiB over it); the store's masters and shadows are registered at
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
    refuse, naming them), at most the gradient pieces a step returns to the host; a number given is
    kept; a negative one is refused by name."""
    arch = shape_of("qwen2.5-7b")
    host = {n: plan(arch, settings(arch, replace(WHOLE, grad_slabs=n))).host_bytes for n in (8, 4, 2)}
    assert host[8] - host[4] == 4 * Layout.of(arch.layer_specs).numel * 4  # a layer's float32 gradient each
    assert settings(arch).grad_slabs == 8 and settings(arch, WHOLE, host=host[8]).grad_slabs == 8
    assert settings(arch, WHOLE, host=host[8] - 1).grad_slabs == 4
    # short of 4 with whole masters: split ones (the compiled update's) hold as many bytes, so 2
    for engine in (EngineConfig(), EAGER):
        short = settings(arch, engine, host=host[4] - 1)
        assert short.split_masters == (engine is not EAGER) and short.grad_slabs == 2
    assert settings(arch, WHOLE, host=host[4] - 1).grad_slabs == 2
    assert settings(arch, WHOLE, host=host[2] - 1).grad_slabs == 2
    assert settings(arch, EngineConfig(grad_slabs=3), host=host[4]).grad_slabs == 3
    # never more than the pieces a step returns to the host: GPT-OSS-120B's shape on 3 layers, the
    # embedding and layer 0 on the device, returns layers 1 and 2 and the head (under one layer's size)
    wide = shape_of("gpt-oss-120b", num_hidden_layers=3)
    assert settings(wide, EngineConfig(device_tiles=2)).grad_slabs == 3
    assert settings(wide, EngineConfig(device_tiles=3)).grad_slabs == 2
    assert settings(wide, EngineConfig(device_tiles=2, grad_slabs=8)).grad_slabs == 8  # as given
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
    # the rotary kernel where the family's rotary is Llama's or GPT-OSS's form: compiled on a GPU,
    # refused for Phi-3's partial rotary
    assert resolve(EngineConfig(), data, OptimConfig(), shape_of("qwen2.5-7b"), gpu).rotary_kernel == "compiled"
    assert resolve(EngineConfig(), data, OptimConfig(), shape_of("gpt-oss-20b"), gpu).rotary_kernel == "compiled"
    assert resolve(EngineConfig(), data, OptimConfig(), shape_of("tiny-phi3"), gpu).rotary_kernel == "eager"
    with pytest.raises(ValueError, match="engine.rotary_kernel: compiled computes the Llama and GPT-OSS forms .* this phi3"):
        resolve(EngineConfig(rotary_kernel="compiled"), data, OptimConfig(), shape_of("tiny-phi3"), gpu)
    with pytest.raises(ValueError, match="engine.experts_kernel: lean is for a mixture of experts"):
        resolve(EngineConfig(experts_kernel="lean"), data, OptimConfig(), shape_of("qwen2.5-7b"), gpu)
    with pytest.raises(ValueError, match="compiles a mixture of experts' gate within the lean experts .set engine"):
        resolve(EngineConfig(experts_kernel="library", mlp_kernel="compiled"), data, OptimConfig(),
                shape_of("gpt-oss-20b"), gpu)


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


@pytest.mark.parametrize("preset, device_tiles, vocab", [("tiny-qwen2", 0, None), ("tiny-llama", 0, None),
                                                          ("tiny-llama", 2, None), ("tiny-llama", 0, 8192),
                                                          ("tiny-qwen2", 0, 8192)])
def test_the_slabs_pieces_are_the_engines(preset, device_tiles, vocab):
    """resolve's count of the gradient pieces a step returns to the host, which caps grad_slabs auto,
    is the engine's own (Engine._contributions: each host tile's pieces of a slab's size), for a tied
    and an untied embedding, with device tiles and without, and with an embedding of many slabs."""
    from megatrain.config import load_config
    from megatrain.resolve import _pieces
    from megatrain.trainer import Trainer
    model = {"preset": preset, **({"overrides": {"vocab_size": vocab}} if vocab else {})}
    trainer = Trainer(load_config(base={"model": model, "engine": {"device": "cpu", "device_tiles": device_tiles},
                                        "optim": {"max_grad_norm": None}, "data": {"seq_len": 16, "batch_size": 1},
                                        "steps": 1}))
    try:
        engine = trainer.engine
        pieces = sum(engine._contributions().values())
        assert pieces == _pieces(engine.shape, trainer.settings) and (pieces > 6) == (vocab is not None)
    finally:
        trainer.close()
