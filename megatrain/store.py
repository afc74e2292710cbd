"""The host store: all persistent training state, one layer-contiguous tile per decoder layer.

A tile holds, for its parameters laid out flat (decayed matrices first, then norms and biases,
each aligned to 64 elements): the master weights and both AdamW moments in one page-aligned block,
and the `shadow`: the compute-dtype copy that streams to the device, kept in pinned memory so each
layer reaches the GPU in one DMA. When the master's dtype is the compute dtype (bf16 masters on
GPU, float32 on CPU) the shadow is the master itself. With float32 masters that is 4 + 4 + 4 + 2 =
14 bytes per parameter.

Gradients are summed over the micro-batches on the device and update a tile straight from the
pinned slab they return into (see optim.py). Only clipping, whose global norm is known at the
step's end, makes every tile keep a float32 gradient buffer (+4 bytes per parameter).

Tiles: 'embed' (the token embedding, also the LM head when tied), 'layer.0' ... 'layer.L-1',
and 'head' (final norm, plus the LM head when untied). The store is built tile by tile from a
seed or from safetensors shards: the whole model never exists as one object.

Device tiles (`engine.device_tiles`): the first tiles the forward reads (the embedding, then
layers 0, 1, ...) can keep their master and moments in spare device memory instead, updated on the
device. Their gradients are the last of a step to arrive and their weights the first the next step
needs, so on the host their update is the one that stays exposed; on the device it takes
milliseconds. Such a tile has no host memory and no shadow: a load casts its master on the device.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from megatrain.config import EngineSettings
from megatrain.shapes import ModelShape, ParamSpec

PAGE = 4096
ALIGN = 64  # elements: every parameter view starts on a 128-byte (bf16) boundary


@dataclass(frozen=True)
class Layout:
    """Where each parameter of a tile sits in its flat buffers."""
    specs: tuple[ParamSpec, ...]  # in checkpoint order
    offsets: tuple[int, ...]
    numel: int  # padded total
    decay_numel: int  # elements [0, decay_numel) take weight decay

    @staticmethod
    def of(specs: list[ParamSpec]) -> "Layout":
        order = sorted(range(len(specs)), key=lambda i: not specs[i].decay)  # stable: decayed first
        offsets = [0] * len(specs)
        cursor = decay_end = 0
        for i in order:
            offsets[i] = cursor
            cursor += -(-specs[i].numel // ALIGN) * ALIGN
            if specs[i].decay:
                decay_end = cursor
        return Layout(tuple(specs), tuple(offsets), cursor, decay_end)

    def views(self, flat: torch.Tensor, base: int = 0) -> list[torch.Tensor]:
        return [flat[base + o: base + o + s.numel].view(s.shape) for s, o in zip(self.specs, self.offsets)]


def _page_aligned(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:  # cudaHostAlloc returns page-aligned memory
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start: start + nbytes]


Alloc = Callable[[int, bool], torch.Tensor]  # (bytes, pinned) -> a page-aligned uint8 block


def _carve(block: torch.Tensor, numel: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Split a byte block into page-aligned flat tensors of the given dtypes."""
    out, cursor = [], 0
    for dtype in dtypes:
        nbytes = numel * dtype.itemsize
        out.append(block[cursor: cursor + nbytes].view(dtype))
        cursor += -(-nbytes // PAGE) * PAGE
    return out


def pinned_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes an allocation of `nbytes` takes: torch's pinned (CUDA host) allocator rounds each
    up to a power of two (a 7B layer's 466 MB shadow takes 512 MiB)."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


def tile_bytes(numel: int, master: torch.dtype, compute: torch.dtype, grad: bool, pinned: bool = False) -> int:
    """Host bytes of one tile (the admission check uses the same arithmetic as the allocation)."""
    def seg(dtype: torch.dtype) -> int:
        return -(-numel * dtype.itemsize // PAGE) * PAGE
    if master == compute:  # the master is its own shadow, in pinned memory
        return pinned_bytes(seg(master), pinned) + (2 + grad) * seg(torch.float32)
    return seg(master) + (2 + grad) * seg(torch.float32) + pinned_bytes(seg(compute), pinned)


class Tile:
    def __init__(self, name: str, layout: Layout, master: torch.dtype, compute: torch.dtype, pinned: bool,
                 grad: bool, device: torch.device | None = None, alloc: Alloc = _page_aligned):
        """`device`: keep master and moments there (a device tile: no shadow, no gradient buffer);
        `alloc(nbytes, pinned)`: where the host blocks come from (a shared arena: distributed.py)."""
        self.name = name
        self.layout = layout
        self.on_device = device is not None
        n = layout.numel
        state = [torch.float32] * (2 + grad)  # the moments, and the gradient buffer if any
        self.grad: torch.Tensor | None = None
        if self.on_device:  # the step's gradient stays in its device accumulator until the update
            self.master = torch.empty(n, dtype=master, device=device)
            self.exp_avg, self.exp_avg_sq = torch.empty(2, n, dtype=torch.float32, device=device)
            self.shadow = None
        elif master == compute:
            # The master streams as it is: it lives in pinned memory and is its own shadow.
            (self.master,) = _carve(alloc(-(-n * master.itemsize // PAGE) * PAGE, pinned), n, [master])
            self.shadow = self.master
            self.exp_avg, self.exp_avg_sq, *rest = self._block(n, state, alloc)
        else:
            self.master, self.exp_avg, self.exp_avg_sq, *rest = self._block(n, [master, *state], alloc)
            (self.shadow,) = _carve(alloc(-(-n * compute.itemsize // PAGE) * PAGE, pinned), n, [compute])
        if grad and not self.on_device:
            self.grad = rest[0]
        # Set while the shadow holds the current weights; cleared from the moment the main thread
        # hands the tile's last gradient of a step to the optimizer until the update is written.
        self.ready = threading.Event()
        self.ready.set()
        self.version = 0  # incremented by each optimizer update
        self.read_done = None  # device event: the last H2D copy out of the shadow has finished
        self.updated = None  # device tiles: event after the last update was issued on the compute stream

    @staticmethod
    def _block(n: int, dtypes: list[torch.dtype], alloc: Alloc) -> list[torch.Tensor]:
        size = sum(-(-n * d.itemsize // PAGE) * PAGE for d in dtypes)
        return _carve(alloc(size, False), n, dtypes)

    def master_views(self) -> list[torch.Tensor]:
        return self.layout.views(self.master)

    @property
    def source(self) -> torch.Tensor:
        """What a load copies into a device buffer: the pinned shadow, or a device tile's master."""
        return self.master if self.on_device else self.shadow

    def refresh_shadow(self, lo: int = 0, hi: int | None = None) -> None:
        if self.shadow is not None and self.shadow is not self.master:
            self.shadow[lo:hi].copy_(self.master[lo:hi])


class HostStore:
    def __init__(self, shape: ModelShape, s: EngineSettings, device: torch.device | None = None,
                 alloc: Alloc = _page_aligned):
        """With clipping every host tile keeps a gradient buffer (updates wait for the global norm);
        the first `s.device_tiles` tiles, in forward order, live on `device` (see the module note).
        `alloc`: where host blocks come from (the ranks' shared arena: distributed.py)."""
        self.shape = shape
        master, compute, pinned, clipping = s.master, s.compute, s.pinned, s.clipping
        where = [device if k < s.device_tiles else None for k in range(shape.num_layers + 1)]
        self.embed = Tile("embed", Layout.of(shape.embed_specs), master, compute, pinned, clipping, where[0], alloc)
        self.layers = [Tile(f"layer.{i}", Layout.of(shape.layer_specs), master, compute, pinned, clipping,
                            where[i + 1], alloc) for i in range(shape.num_layers)]
        self.head = Tile("head", Layout.of(shape.head_specs), master, compute, pinned, clipping, None, alloc)

    @property
    def tiles(self) -> list[Tile]:
        """All tiles in the order the forward pass first reads them."""
        return [self.embed, *self.layers, self.head]

    @staticmethod
    def nbytes(shape: ModelShape, s: EngineSettings) -> tuple[int, int]:
        """(host bytes, device bytes) of the store, by the same arithmetic as its allocation."""
        host = device = 0
        for k, specs in enumerate([shape.embed_specs, *[shape.layer_specs] * shape.num_layers, shape.head_specs]):
            numel = Layout.of(specs).numel
            if k < s.device_tiles:
                device += numel * (s.master.itemsize + 8)
            else:  # a shared store is one registered file: no power-of-two rounding of pinned blocks
                host += tile_bytes(numel, s.master, s.compute, s.clipping, s.pinned and s.ranks == 1)
        return host, device

    # ---- filling the store ----
    def init_random(self, seed: int, only: list[Tile] | None = None) -> None:
        """Seeded init in the `transformers` manner (ParamSpec.init): N(0, initializer_range) matrices
        and attention sinks, unit norms, zero biases.

        Each tile draws from its own generator, so the result does not depend on tile order;
        `only`: these tiles (a shared store's other ranks fill their device tiles alone).
        """
        std = getattr(self.shape.config, "initializer_range", 0.02)
        for index, tile in enumerate(self.tiles):
            if only is not None and tile not in only:
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
            tile.master.zero_()
            for spec, view in zip(tile.layout.specs, tile.master_views()):
                if spec.init == "normal":
                    view.copy_(torch.empty(spec.shape).normal_(0.0, std, generator=gen))
                elif spec.init == "ones":
                    view.fill_(1.0)
            self._reset_state(tile)

    def load_pretrained(self, directory: str | Path, only: list[Tile] | None = None) -> None:
        """Copy a local safetensors checkpoint into the tiles (`only`: these), one tensor at a time."""
        directory = Path(directory)
        files = pretrained_shards(directory)
        tiles = self.tiles if only is None else only
        where, skip = {}, set()
        for tile in self.tiles:
            for name, view in self.shape.checkpoint_tensors(tile.name, tile.master_views()):
                if tile in tiles:
                    where[name] = view
                else:
                    skip.add(name)
        for tile in tiles:
            tile.master.zero_()
        missing = set(where)
        unexpected = []
        for file in files:
            with _shard(file) as f:
                for name in f.keys():
                    if name in skip:
                        continue
                    if name not in where:
                        if not (self.shape.tied and name == "lm_head.weight") and "rotary_emb" not in name:
                            unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(where[name].shape):
                        raise ValueError(f"model.pretrained: {name} has shape {tuple(tensor.shape)}, "
                                         f"the config implies {tuple(where[name].shape)}")
                    where[name].copy_(tensor)
                    missing.discard(name)
        if missing or unexpected:
            raise ValueError(f"model.pretrained: checkpoint does not match the config: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        for tile in tiles:
            self._reset_state(tile)

    @staticmethod
    def _reset_state(tile: Tile) -> None:
        tile.exp_avg.zero_()
        tile.exp_avg_sq.zero_()
        if tile.grad is not None:
            tile.grad.zero_()
        tile.refresh_shadow()
        tile.ready.set()


def _shard(path: Path):
    """A safetensors shard opened for reading, or a ValueError that names it."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # a truncated or garbage file: safetensors' own error type
        raise ValueError(f"model.pretrained: {path} is not a readable safetensors file ({e})") from None


def pretrained_shards(directory: Path) -> list[Path]:
    """The safetensors shards of a local checkpoint, each header read: a missing, truncated or
    garbage shard is refused by name before anything is allocated."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"model.pretrained: {index} is not a safetensors index ({e})") from None
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.pretrained: no safetensors files in {directory}")
    for file in files:
        if not file.is_file():
            raise ValueError(f"model.pretrained: {file}, named in the index, does not exist")
        with _shard(file):
            pass
    return files

