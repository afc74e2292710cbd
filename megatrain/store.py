"""The host store: all persistent training state, one layer-contiguous tile per decoder layer.

A tile holds, for its parameters laid out flat (decayed matrices first, then norms and biases,
each aligned to 64 elements): the master weights, in pinned memory so that each layer reaches the
GPU in one DMA, and both AdamW moments in one page-aligned block. A load copies the master to the
device as it is; where its dtype is not the compute dtype (float32 masters with bf16 compute) it is
cast there, the same round to nearest even as a cast on the host, so nothing on the host holds a
compute-dtype copy to keep current: the update moves torch's fused AdamW's bytes, 28 a parameter
with a float32 gradient, and a tile is 12 bytes a parameter.

Float32 masters with bf16 compute can be held split (`engine.split_masters`, docs/host-store.md):
the `shadow`, the float32 master rounded to nearest even, is the master's high half, pinned, and
the block keeps only its low 16 bits (`low`), so the master is 2 + 2 bytes and a load copies the
shadow alone: half the bytes over the link of a whole master's load. The master is recovered
exactly from the two halves (`join`); the one case two halves cannot tell apart, a master exactly
halfway between two bf16 values and rounded down, is flagged in the sign bit of its `exp_avg_sq`,
which AdamW never makes negative.

Gradients are summed over the micro-batches on the device and update a tile straight from the
pinned slab they return into (see host_executor.py). Only clipping, whose global norm is known at the
step's end, makes every tile keep a float32 gradient buffer (+4 bytes per parameter): pinned, like the
master, so that the gradient returns straight into it, with no slab and no copy on the host.

Tiles: 'embed' (the token embedding, also the LM head when tied), 'layer.0' ... 'layer.L-1',
and 'head' (final norm, plus the LM head when untied). The store is built tile by tile from a
seed or from safetensors shards: the whole model never exists as one object.

Device tiles (`engine.device_tiles`): the first tiles the forward reads (the embedding, then
layers 0, 1, ...) can keep their master and moments in spare device memory instead, updated on the
device. Their gradients are the last of a step to arrive and their weights the first the next step
needs, so on the host their update is the one that stays exposed; on the device it takes
milliseconds. Such a tile has no host memory: a load casts its master on the device.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from safetensors import safe_open

from megatrain.config import EngineSettings
from megatrain.progress import Advance, nothing
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

    @property
    def params(self) -> int:
        """The parameters, without the padding."""
        return sum(spec.numel for spec in self.specs)

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

    def padding(self, flat: torch.Tensor, base: int = 0) -> list[torch.Tensor]:
        """The elements between and after the views: what no parameter holds."""
        ends = sorted((o, o + s.numel) for s, o in zip(self.specs, self.offsets))
        gaps = [(end, start) for (_, end), (start, _) in zip(ends, [*ends[1:], (self.numel, self.numel)])]
        return [flat[base + a: base + b] for a, b in gaps if b > a]


def page_aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start: start + nbytes]


class Blocks:
    """Where a store's page-aligned blocks come from (`take(nbytes)`: fresh memory, or the ranks'
    shared file: distributed.py), the pinned ones, the masters and shadows the device copies from,
    registered with CUDA (cudaHostRegister) at their exact size until `close`. Not torch's pinned
    allocator: it rounds each block up to a power of two, and a 14B layer's 550 MB shadow took 1 GiB."""

    def __init__(self, take: Callable[[int], torch.Tensor] = page_aligned, register: bool = False):
        self.take = take
        self.register = register
        self.registered: list[torch.Tensor] = []

    def __call__(self, nbytes: int, pinned: bool) -> torch.Tensor:
        block = self.take(nbytes)
        if pinned and self.register:
            err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of a host store block ({nbytes} bytes) failed: {err}")
            self.registered.append(block)
        return block

    def close(self) -> None:
        if self.registered:
            torch.cuda.synchronize()  # no copy still reads them
        for block in self.registered:
            torch.cuda.cudart().cudaHostUnregister(block.data_ptr())
        self.registered.clear()


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
    up to a power of two (a 7B layer's 932 MB float32 gradient slab takes 1 GiB)."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes > 0 else nbytes


def can_split(master: torch.dtype, compute: torch.dtype) -> bool:
    """A host tile of these dtypes can keep its master as the shadow plus the low halves."""
    return master == torch.float32 and compute == torch.bfloat16


def tile_bytes(numel: int, master: torch.dtype, compute: torch.dtype, grad: bool, split: bool = False) -> int:
    """Host bytes of one tile (the admission check uses the same arithmetic as the allocation);
    `split`: its master held split, where the dtypes allow it."""
    def seg(dtype: torch.dtype) -> int:
        return -(-numel * dtype.itemsize // PAGE) * PAGE
    state = (2 + grad) * seg(torch.float32)
    if split and can_split(master, compute):  # the shadow and the low halves
        return seg(compute) + seg(torch.int16) + state
    return seg(master) + state


# ---- split masters (docs/host-store.md) ----
TIE = -(1 << 15)  # the low half of a master halfway between two bf16 values
_ROW, _SUB = 1024, 64  # the search for TIE: minima over rows, then over the sub-rows of rows that hold one
_SIGN = -(1 << 31)
# elements per thread of one block of a join's or split's casts: each cast is a pass over memory,
# and a block's float32 master and widened low halves stay in the cores' caches between them (on the
# 2-core box, 1 thread: 2^16-2^18 alike, 2^14 and 2^20 slower; more threads favour fewer blocks)
_BLOCK = 1 << 18
# elements a seeded draw that cannot go in place, or a split tile's write, takes at a time: the
# fill's threads each hold one such float32 chunk, not a whole matrix (a GPT-OSS-120B layer's
# experts are 2.1 G elements, and the fill draws up to a core's worth of layers at once)
_DRAW = 1 << 22
INIT_CHUNK = 1 << 24  # elements of a matrix drawn by one generator (init_random)


def _blocks(n: int) -> Iterator[tuple[int, int]]:
    step = _BLOCK * torch.get_num_threads()
    return ((c, min(n, c + step)) for c in range(0, n, step))


def _ties(low: torch.Tensor) -> torch.Tensor:
    """Positions (int64) where `low` (int16) holds TIE: about one element in 2^16 of trained weights.
    Two reductions read `low` once; what follows touches a few sub-rows (below torch's grain size,
    so it runs on the calling thread alone)."""
    body = low.numel() - low.numel() % _ROW
    subs = low[:body].view(-1, _SUB)
    sub_min = subs.amin(1).view(-1, _ROW // _SUB)  # per row of _ROW, its sub-rows' minima
    hit = (sub_min.amin(1) == TIE).nonzero().squeeze(1)
    at = []
    if hit.numel():
        r, c = (sub_min[hit] == TIE).nonzero().unbind(1)
        sub = hit[r] * (_ROW // _SUB) + c  # sub-rows holding a TIE
        i, j = (subs[sub] == TIE).nonzero().unbind(1)
        at.append(sub[i] * _SUB + j)
    if body < low.numel():
        at.append((low[body:] == TIE).nonzero().squeeze(1) + body)
    return torch.cat(at) if len(at) > 1 else at[0] if at else hit


def split(master: torch.Tensor, shadow: torch.Tensor, low: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """Store float32 `master` as its bf16 `shadow` (rounded to nearest even, the cast the stream
    has always had) and its `low` 16 bits; flag in `exp_avg_sq`'s sign the halfway masters that were
    rounded down (their two halves read as the master 2^16 below). All 1-D, of one length."""
    bits = master.view(torch.int32)
    for c, d in _blocks(master.numel()):
        shadow[c:d].copy_(master[c:d])
        low[c:d].copy_(bits[c:d])  # int32 -> int16 keeps the low 16 bits
    at = _ties(low)
    if at.numel():
        down = (bits[at] & -(1 << 16)) == (shadow.view(torch.int16)[at].to(torch.int32) << 16)
        v = exp_avg_sq.view(torch.int32)
        flags = v[at]
        v[at] = torch.where(down, flags | _SIGN, flags & ~_SIGN)


def join(shadow: torch.Tensor, low: torch.Tensor, exp_avg_sq: torch.Tensor, out: torch.Tensor,
         wide: torch.Tensor | None = None, take: bool = False) -> torch.Tensor:
    """The float32 masters `split` stored, into `out`; `wide`: int32 scratch of at least one block's
    length (_blocks), or of the same length.
    `take`: clear the flags too, leaving `exp_avg_sq` as AdamW expects it (then `split` must follow)."""
    blocks = list(_blocks(low.numel()))
    wide = torch.empty(blocks[0][1] if blocks else 0, dtype=torch.int32) if wide is None else wide
    bits = out.view(torch.int32)
    for c, d in blocks:
        out[c:d].copy_(shadow[c:d])  # bf16 -> float32 is exact: the bf16 bits become the high half, the low half 0
        w = wide[: d - c]
        w.copy_(low[c:d])  # sign-extended: the master minus its shadow, in units of the last place
        bits[c:d].add_(w)
    at = _ties(low)
    if at.numel():
        v = exp_avg_sq.view(torch.int32)
        flags = v[at]
        bits[at] += (flags < 0).to(torch.int32) << 16
        if take:
            v[at] = flags & ~_SIGN
    return out


class Storage(Enum):
    """Where a tile keeps its master and what a load streams from: each kind's tensors (None where
    the kind has none) and its path through the update (adamw.py)."""
    DEVICE = "device"  # master and moments in device memory; a load casts the master there
    MASTER = "master"  # a whole master, pinned: a load copies it as it is and casts it on the device
    SPLIT = "split"  # float32 master as the pinned bf16 shadow (its high half) and `low` in the block


class Tile:
    def __init__(self, name: str, layout: Layout, master: torch.dtype, compute: torch.dtype, pinned: bool,
                 grad: bool, device: torch.device | None = None, alloc: Alloc | None = None, split: bool = False):
        """`device`: keep master and moments there (a device tile: no gradient buffer);
        `alloc(nbytes, pinned)`: where the host blocks come from (its store's `Blocks`);
        `split`: a host tile with float32 masters and bf16 compute keeps the masters as a bf16 shadow
        and their low halves."""
        alloc = alloc or Blocks(register=pinned)  # a tile alone (probes, tests); a store passes its own
        self.name = name
        self.layout = layout
        self.master_dtype = master
        if device is not None:
            self.storage = Storage.DEVICE
        else:
            self.storage = Storage.SPLIT if split and can_split(master, compute) else Storage.MASTER
        n = layout.numel
        state = [torch.float32] * 2  # the moments
        self.grad: torch.Tensor | None = None
        self.master: torch.Tensor | None = None
        self.low: torch.Tensor | None = None
        self.shadow: torch.Tensor | None = None
        if self.storage is Storage.DEVICE:  # the step's gradient stays in its device accumulator until the update
            self.master = torch.empty(n, dtype=master, device=device)
            self.exp_avg, self.exp_avg_sq = torch.empty(2, n, dtype=torch.float32, device=device)
        elif self.storage is Storage.MASTER:
            (self.master,) = _carve(alloc(-(-n * master.itemsize // PAGE) * PAGE, pinned), n, [master])
            self.exp_avg, self.exp_avg_sq = self._block(n, state, alloc)
        else:
            self.low, self.exp_avg, self.exp_avg_sq = self._block(n, [torch.int16, *state], alloc)
            (self.shadow,) = _carve(alloc(-(-n * compute.itemsize // PAGE) * PAGE, pinned), n, [compute])
        if grad and not self.on_device:  # the step's gradient returns into it from the device
            (self.grad,) = _carve(alloc(-(-n * 4 // PAGE) * PAGE, pinned), n, [torch.float32])
        # Set while the master holds the current weights; cleared from the moment the main thread
        # hands the tile's last gradient of a step to the optimizer until the update is written.
        self.ready = threading.Event()
        self.ready.set()
        self.version = 0  # incremented by each optimizer update
        self.read_done = None  # device event: the last H2D copy out of the master (or shadow) has finished
        self.updated = None  # device tiles: event after the last update was issued on the compute stream

    @property
    def on_device(self) -> bool:
        return self.storage is Storage.DEVICE

    @staticmethod
    def _block(n: int, dtypes: list[torch.dtype], alloc: Alloc) -> list[torch.Tensor]:
        size = sum(-(-n * d.itemsize // PAGE) * PAGE for d in dtypes)
        return _carve(alloc(size, False), n, dtypes)

    @property
    def source(self) -> torch.Tensor:
        """What a load copies into a device buffer: the master, or a split tile's shadow."""
        return self.shadow if self.storage is Storage.SPLIT else self.master

    def read_master(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of the master in its dtype: a view, or a split tile's, joined (a copy)."""
        if self.storage is not Storage.SPLIT:
            return self.master[lo:hi]
        return join(self.shadow[lo:hi], self.low[lo:hi], self.exp_avg_sq[lo:hi],
                    torch.empty(self.shadow[lo:hi].numel(), dtype=torch.float32))

    def master_views(self) -> list[torch.Tensor]:
        """Each parameter's master, shaped (views, or a split tile's joined copies)."""
        return [self.read_master(o, o + s.numel).view(s.shape) for s, o in zip(self.layout.specs, self.layout.offsets)]

    def write_master(self, values: torch.Tensor, lo: int = 0) -> None:
        """Set elements [lo, lo + values.numel()) of the master. A split tile's flags live in
        `exp_avg_sq`: write the moments first."""
        hi = lo + values.numel()
        values = values.reshape(-1)
        if self.storage is Storage.SPLIT:  # through float32 chunks of _DRAW elements: a checkpoint's bf16 tensor is not widened whole
            for a in range(lo, hi, _DRAW):
                b = min(hi, a + _DRAW)
                split(values[a - lo: b - lo].to(torch.float32).contiguous(), self.shadow[a:b], self.low[a:b],
                      self.exp_avg_sq[a:b])
            return
        self.master[lo:hi].copy_(values)

    def draw_normal(self, lo: int, n: int, std: float, gen: torch.Generator) -> None:
        """Elements [lo, lo + n) of the master drawn from N(0, std) by `gen`. A whole float32
        master on the host takes the draws in place, the same numbers a drawn tensor
        holds (torch's normal_ does not depend on where the elements sit); the others go through
        one. In place, the store's fill skips a fresh temporary per matrix: on the 2-core machine
        two threads filling 8 x 70 M elements took 1.24 s in place against 1.72-2.31 s through them."""
        if self.master_dtype == torch.float32 and self.storage is Storage.MASTER:
            self.master[lo:lo + n].normal_(0.0, std, generator=gen)
        else:  # in chunks of _DRAW, each a multiple of 16 and the last at least _DRAW long: torch
            # draws a float tensor's normals as blocks of 16 from one stream of uniforms, so the
            # chunks hold the numbers of one whole draw
            start = lo
            while start < lo + n:
                end = lo + n if lo + n - start < 2 * _DRAW else start + _DRAW
                self.write_master(torch.empty(end - start).normal_(0.0, std, generator=gen), start)
                start = end

    def arrays(self) -> list[torch.Tensor]:
        """The tile's flat arrays: master, low halves, shadow, moments, gradient buffer (those it keeps)."""
        return [t for t in (self.master, self.low, self.shadow, self.exp_avg, self.exp_avg_sq, self.grad) if t is not None]

    def reset(self) -> None:
        """Zero the master (a split one's halves), the moments and the gradient buffer."""
        for t in self.arrays():
            t.zero_()
        self.ready.set()

    @contextmanager
    def plain_state(self) -> Iterator[dict[str, torch.Tensor]]:
        """Master and moments as a resume saves them, while the block runs: a split tile's master
        joined (one tile's float32 copy), its flags out of `exp_avg_sq` and put back after."""
        if self.storage is not Storage.SPLIT:
            yield {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
            return
        master = join(self.shadow, self.low, self.exp_avg_sq, torch.empty(self.layout.numel), take=True)
        try:
            yield {"master": master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        finally:
            self.write_master(master)


class HostStore:
    def __init__(self, shape: ModelShape, s: EngineSettings, device: torch.device | None = None,
                 take: Callable[[int], torch.Tensor] = page_aligned):
        """With clipping every host tile keeps a gradient buffer (updates wait for the global norm);
        the first `s.device_tiles` tiles, in forward order, live on `device` (see the module note).
        `take(nbytes)`: where host blocks come from (the ranks' shared file: distributed.py)."""
        self.shape = shape
        master, compute, pinned, clipping, split = s.master, s.compute, s.pinned, s.clipping, s.split_masters
        self.blocks = alloc = Blocks(take, register=pinned)
        where = [device if k < s.device_tiles else None for k in range(shape.num_layers + 1)] + [None]  # the head's on the host
        self.embed, *self.layers, self.head = [Tile(name, Layout.of(specs), master, compute, pinned, clipping, at, alloc, split)
                                              for (name, specs), at in zip(shape.units(), where, strict=True)]
        # each layer's persistent buffers, float32 on the compute device as the library keeps them
        # (DeepSeek-V3's e_score_correction_bias: _keep_in_fp32_modules_strict), never trained: no tile
        # holds them, so no update or weight decay reaches them; every rank has its own
        self.buffers = [[torch.zeros(b.shape, dtype=torch.float32, device=device) for b in shape.buffer_specs(i)]
                        for i in range(shape.num_layers)]

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """Every layer's buffers by their names in the library's checkpoints."""
        return [pair for i, buffers in enumerate(self.buffers)
                for pair in zip(self.shape.buffer_names(i), buffers, strict=True)]

    @property
    def tiles(self) -> list[Tile]:
        """All tiles in the order the forward pass first reads them."""
        return [self.embed, *self.layers, self.head]

    @staticmethod
    def nbytes(shape: ModelShape, s: EngineSettings) -> tuple[int, int]:
        """(host bytes, device bytes: the device tiles' and the layers' buffers) of the store, by the
        same arithmetic as its allocation."""
        host, device = 0, sum(4 * b.numel for i in range(shape.num_layers) for b in shape.buffer_specs(i))
        for k, (_, specs) in enumerate(shape.units()):
            numel = Layout.of(specs).numel
            if k < s.device_tiles:
                device += numel * (s.master.itemsize + 8)
            else:
                host += tile_bytes(numel, s.master, s.compute, s.clipping, s.split_masters)
        return host, device

    def close(self) -> None:
        """Unregister the pinned blocks (the device no longer reads them)."""
        self.blocks.close()

    # ---- filling the store ----
    def init_random(self, seed: int, only: list[Tile] | None = None, advance: Advance = nothing) -> None:
        """Seeded init in the `transformers` manner (ParamSpec.init): N(0, initializer_range) matrices
        and attention sinks, unit norms, zero biases.

        Each piece of INIT_CHUNK elements of a matrix draws from a generator of its own, seeded by the
        run's seed, its tile, its matrix and its place there, so the result depends on no order and
        no thread count, and the pieces are filled in parallel (`in_parallel`), after the tiles'
        arrays are zeroed in pieces the same way: one thread's draws run at about 0.2 G numbers per
        second, and a model of few wide layers (GPT-OSS-120B's shape on 3 layers: 5 tiles) would
        otherwise fill on as many threads as it has tiles; `only`: these tiles
        (a shared store's other ranks fill their device tiles alone); `advance(n)` as each piece's n
        parameters are filled. The layers' buffers are zeros, as the library initialises
        DeepSeek-V3's correction bias.
        """
        std = getattr(self.shape.config, "initializer_range", 0.02)
        for _, buffer in self.named_buffers():
            buffer.zero_()
        tiles = [(i, t) for i, t in enumerate(self.tiles) if only is None or t in only]

        def draw(tile: Tile, lo: int, n: int, key: tuple[int, ...]) -> None:
            tile.draw_normal(lo, n, std, torch.Generator().manual_seed(_seed(*key)))
            advance(n)
        # the arrays zeroed in pieces on every thread too: their memory (all but the registered
        # masters and shadows) is first written here, its pages faulted in, which a thread a tile did on 5 threads
        # for GPT-OSS-120B's shape on 3 layers
        in_parallel(torch.Tensor.zero_, [(t[a:a + INIT_CHUNK],) for _, tile in tiles for t in tile.arrays()
                                         for a in range(0, t.numel(), INIT_CHUNK)])
        for _, tile in tiles:
            for spec, offset in zip(tile.layout.specs, tile.layout.offsets):
                if spec.init == "ones":
                    tile.write_master(torch.ones(spec.numel), offset)
            advance(sum(spec.numel for spec in tile.layout.specs if spec.init != "normal"))
        in_parallel(draw, [(tile, offset + a, min(INIT_CHUNK, spec.numel - a), (seed, index, k, a // INIT_CHUNK))
                           for index, tile in tiles
                           for k, (spec, offset) in enumerate(zip(tile.layout.specs, tile.layout.offsets))
                           if spec.init == "normal" for a in range(0, spec.numel, INIT_CHUNK)])

    def load_pretrained(self, directory: str | Path, only: list[Tile] | None = None, advance: Advance = nothing) -> None:
        """Copy a local safetensors checkpoint (check_pretrained: its names and shapes are the
        config's) into the tiles (`only`: these; the layers' buffers on every rank), one tensor at a
        time; `advance(n)` as each tensor's n parameters are in."""
        files = check_pretrained(self.shape, Path(directory))
        tiles = self.tiles if only is None else only
        buffers = dict(self.named_buffers())
        where = {}  # name -> (tile, offset): a contiguous range of the tile
        for tile in tiles:
            layout = torch.empty(tile.layout.numel, device="meta")  # views that know their offsets
            for name, view in self.shape.checkpoint_tensors(tile.name, tile.layout.views(layout)):
                assert view.is_contiguous(), name
                where[name] = (tile, view.storage_offset())
            tile.reset()
        for file in files:
            with _shard(file) as f:
                for name in f.keys():
                    if name in buffers:
                        buffers[name].copy_(f.get_tensor(name))
                    elif name in where:
                        tensor = f.get_tensor(name)
                        tile, offset = where[name]
                        tile.write_master(tensor, offset)
                        advance(tensor.numel())


def _seed(*key: int) -> int:
    """A generator's seed from integers, the same in every process (Python's hash of a tuple is too,
    but not documented so)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1


def in_parallel(fn: Callable[..., None], jobs: list[tuple]) -> None:
    """`fn(*job)` for every job, on as many threads as torch's intra-op pool has, each job's own
    ops on one thread (the pool is set to 1 meanwhile: no thread fans out again); the first error
    is raised once all have stopped."""
    before = torch.get_num_threads()
    threads = min(before, len(jobs))
    if threads <= 1:
        for job in jobs:
            fn(*job)
        return
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(threads) as pool:
            for done in [pool.submit(fn, *job) for job in jobs]:
                done.result()
    finally:
        torch.set_num_threads(before)


def _shard(path: Path):
    """A safetensors shard opened for reading, or a ValueError that names it."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # a truncated or garbage file: safetensors' own error type
        raise ValueError(f"model.pretrained: {path} is not a readable safetensors file ({e})") from None


def checkpoint_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `shape` stores (ModelShape.checkpoint_tensors), with its shape;
    from the tiles' layouts on the meta device: nothing is allocated."""
    out = {}
    for name, specs in shape.units():
        layout = Layout.of(specs)
        views = layout.views(torch.empty(layout.numel, device="meta"))
        out.update((n, tuple(v.shape)) for n, v in shape.checkpoint_tensors(name, views))
    for i in range(shape.num_layers):
        out.update((n, b.shape) for n, b in zip(shape.buffer_names(i), shape.buffer_specs(i), strict=True))
    return out


def check_pretrained(shape: ModelShape, directory: Path) -> list[Path]:
    """The shards of a local checkpoint of `shape`, their headers read and their tensors' names and
    shapes checked against the config's: a missing, truncated or garbage shard, or a checkpoint of
    another model, is refused by name before anything is allocated."""
    files = pretrained_shards(directory)
    expected = checkpoint_shapes(shape)
    found = {}
    for file in files:
        with _shard(file) as f:
            found.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
    missing = sorted(set(expected) - set(found))
    # what the library's model skips on loading too (DeepSeek-V3's multi-token-prediction layer 61)
    ignored = getattr(shape.modeling, f"{shape.prefix}PreTrainedModel")._keys_to_ignore_on_load_unexpected or []
    unexpected = sorted(n for n in set(found) - set(expected)
                        if not (shape.tied and n == "lm_head.weight") and "rotary_emb" not in n
                        and not any(re.search(pattern, n) for pattern in ignored))
    if any(n.endswith(("_blocks", "_scales")) for n in unexpected):  # the published GPT-OSS weights
        raise ValueError(
            f"model.pretrained: {directory} holds MXFP4-quantized experts ({unexpected[0]}, ...); the engine "
            "trains plain weights: dequantize them once with transformers, AutoModelForCausalLM.from_pretrained("
            "path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(out), "
            "and point model.pretrained at out")
    if missing or unexpected:
        raise ValueError(f"model.pretrained: checkpoint does not match the config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, dims in expected.items():
        if found[name] != dims:
            raise ValueError(f"model.pretrained: {name} has shape {found[name]}, the config implies {dims}")
    return files


def pretrained_shards(directory: Path) -> list[Path]:
    """The safetensors shards of a local checkpoint, each header read: a missing, truncated or
    garbage shard is refused by name."""
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

