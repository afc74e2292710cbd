"""The host store (megatrain/store.py): its layout (aligned, decayed parameters first, one block a
layer), its bytes per parameter with whole or split float32 masters, and its seeded initial weights."""
from __future__ import annotations


import pytest
import torch

from helpers import settings, shape_of
from megatrain.config import EngineConfig
import megatrain.store as store_module
from megatrain.shapes import ParamSpec
from megatrain.store import ALIGN, PAGE, HostStore, Layout, Storage, Tile

SPLIT = EngineConfig(split_masters=True)


def test_layout_is_aligned_and_decay_first():
    arch = shape_of("tiny-qwen2")
    layout = Layout.of(arch.layer_specs)
    assert all(o % ALIGN == 0 for o in layout.offsets)
    for spec, offset in zip(layout.specs, layout.offsets):
        assert (offset < layout.decay_numel) == spec.decay
    assert HostStore(arch, settings(arch)).layers[0].storage is Storage.SPLIT  # auto, with the compiled update
    eager = EngineConfig(optimizer_kernel="eager")  # auto, the eager update with the host to spare: whole masters
    assert HostStore(arch, settings(arch, eager)).layers[0].storage is not Storage.SPLIT
    store = HostStore(arch, settings(arch, SPLIT, clipping=True))
    tile = store.layers[0]
    assert tile.storage is Storage.SPLIT and tile.master is None  # float32 masters, bf16 shadow: the master's low halves only
    for t in (tile.low, tile.exp_avg, tile.exp_avg_sq, tile.grad, tile.shadow):
        assert t.data_ptr() % PAGE == 0
    # one layer-contiguous block: the low halves and moments follow each other; the gradient buffer,
    # which the device copies into, is a block of its own, pinned where the shadow is
    assert tile.exp_avg.data_ptr() > tile.low.data_ptr() and tile.exp_avg_sq.data_ptr() > tile.exp_avg.data_ptr()
    assert not tile.low.data_ptr() <= tile.grad.data_ptr() <= tile.exp_avg_sq.data_ptr()
    assert arch.tied and [s.name for s in store.head.layout.specs] == ["norm.weight"]  # the LM head is the embedding


def test_padding_is_what_no_parameter_holds():
    """A layout's views and its padding cover its buffer once each (the step gradient's first
    micro-batch is copied into the views and zeroes only the padding)."""
    layout = Layout.of(shape_of("tiny-qwen2").layer_specs)
    flat = torch.zeros(layout.numel)
    for t in (*layout.views(flat), *layout.padding(flat)):
        t.add_(1)
    assert torch.equal(flat, torch.ones(layout.numel)) and layout.padding(flat)
    assert sum(p.numel() for p in layout.padding(flat)) == layout.numel - layout.params


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_host_bytes_per_parameter(split):
    """float32 masters with bf16 compute: 12 bytes per parameter without clipping (master and
    moments; no bf16 copy: a load casts on the device), 16 with it (a float32 gradient waits for the
    global norm); split (engine.split_masters) as many: the master's low halves beside the shadow
    that is its high halves."""
    arch = shape_of("tiny-llama", num_hidden_layers=8)
    engine = EngineConfig(split_masters=split)
    for clipping, per_param in ((False, 12), (True, 16)):
        store = HostStore(arch, settings(arch, engine, clipping=clipping))
        layer = store.layers[0]
        assert (layer.storage is Storage.SPLIT) == split and (layer.master is None) == split == (layer.shadow is not None)
        assert (layer.grad is not None) == clipping and (store.embed.grad is not None) == clipping
        per_layer = HostStore.nbytes(arch, settings(arch, engine, clipping=clipping))[0]
        deeper = shape_of("tiny-llama", num_hidden_layers=16)
        growth = HostStore.nbytes(deeper, settings(deeper, engine, clipping=clipping))[0] - per_layer
        # 8 more layers cost per_param bytes per parameter, each buffer rounded up to a page
        n = layer.layout.numel
        assert 8 * per_param * n <= growth <= 8 * (per_param * n + 5 * PAGE)


def test_random_init_depends_on_no_thread_count_or_tile_subset(monkeypatch):
    """init_random: each piece of a matrix (INIT_CHUNK elements, here 1000: the tiny model's matrices
    span several) draws from a generator of its own, so the store is the same on one thread and on
    several, and filling some tiles (a shared store's rank) gives them what the whole fill does;
    matrices N(0, initializer_range), norms ones, biases zero."""
    monkeypatch.setattr(store_module, "INIT_CHUNK", 1000)
    arch = shape_of("tiny-qwen2")
    def filled(threads, only=None):
        store = HostStore(arch, settings(arch, compute="float32"))
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            store.init_random(3, None if only is None else [store.tiles[i] for i in only])
        finally:
            torch.set_num_threads(before)
        return [t.master.clone() for t in store.tiles]
    one, two, some = filled(1), filled(2), filled(2, only=[1, 3])
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(some[1], one[1]) and torch.equal(some[3], one[3])
    std = getattr(arch.config, "initializer_range", 0.02)
    layer = HostStore(arch, settings(arch, compute="float32")).tiles[1].layout
    for spec, offset in zip(layer.specs, layer.offsets):
        values = one[1][offset: offset + spec.numel]
        if spec.init == "normal":
            assert spec.numel < 1000 or abs(values.std().item() / std - 1) < 0.1, spec.name
            if spec.numel > 2000:  # pieces of one matrix are not one stream drawn again
                assert not torch.equal(values[:1000], values[1000:2000])
        else:
            assert torch.equal(values, torch.ones(spec.numel) if spec.init == "ones" else torch.zeros(spec.numel))


@pytest.mark.parametrize("master, split", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("chunk", [1 << 22, 64])
def test_drawn_weights_are_those_of_a_drawn_tensor(master, split, chunk, monkeypatch):
    """A tile's seeded draws, in place into a whole float32 master or through a tensor otherwise
    (in chunks, here also of 64 elements: 1961 = 29 x 64 + 105), are the numbers torch draws into a
    tensor of their own (the store's init did so before), in the master (and a split one's bf16
    shadow)."""
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
        assert torch.equal(tile.source[offset: offset + spec.numel].to(torch.bfloat16), want.to(master).to(torch.bfloat16))
