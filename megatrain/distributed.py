"""Data parallelism through torch.distributed: the ranks, the host store they share, who updates
which part of each tile, the gradient reduction and the per-tile readiness flags.

Launched by `torchrun` (one process per GPU; NCCL between GPUs, gloo on the CPU), from the
`megatrain` command, the Python API or the harness alike; `Ranks.from_env` reads what torchrun
sets. With one process nothing here runs a collective (`Comm.single()`).

Where the state lives (docs/data-parallel.md):
  - one host store per host, in one shared-memory file (`SharedArena`) that the host's local rank
    0 creates and every local rank maps; the file is unlinked as soon as all have mapped it, so a
    crash leaves nothing in /dev/shm. On a GPU each process registers the blocks the device copies
    from (the shadows) with cudaHostRegister, as a one-process store does (store.Blocks).
  - each local rank owns one contiguous part of every host tile (`part`): it gets the summed
    gradient of that part (reduce-scatter among the host's ranks, then all-reduce among the ranks of
    the same local rank on other hosts) and its CPU optimizer updates that part only.
  - device tiles stay one copy per GPU: their gradient is all-reduced whole and every rank updates
    its copy identically.
  - readiness: a rank may load a tile once every owner of a part of it has published as many
    updates of it as this rank has (`Flags`: one counter per tile and local rank in the shared
    file), an explicit flag exchange, not a timing assumption.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain.batch import Batch
from megatrain.store import ALIGN, PAGE

SHM_DIR = Path("/dev/shm")
POLL_S = 1e-4  # between reads of a peer's flag (a wait only while a peer's update is running)


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks, as torchrun describes it."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1  # ranks on this host: they share one host store
    node: int = 0  # this host's index (torchrun's GROUP_RANK)

    @property
    def nodes(self) -> int:
        return self.world // self.local_world

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @staticmethod
    def from_env(env=os.environ) -> "Ranks":
        """From torchrun's variables; one rank when they are not set."""
        if "WORLD_SIZE" not in env or int(env["WORLD_SIZE"]) == 1:
            return Ranks()
        world, local_world = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        if world % local_world:
            raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}: every host "
                             f"must run the same number of ranks (torchrun --nproc-per-node)")
        return Ranks(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world,
                     int(env.get("GROUP_RANK", int(env["RANK"]) // local_world)))


def check(ranks: Ranks, batch_size: int, device_type: str, gpus: int) -> None:
    """Refuse, before anything is allocated, a combination the ranks cannot run."""
    if not ranks.distributed:
        return
    if device_type == "cuda" and ranks.local_world > gpus:
        raise ValueError(f"{ranks.local_world} ranks on this host but {gpus} GPU(s): run one rank per GPU "
                         f"(torchrun --nproc-per-node {gpus})")
    if batch_size and batch_size % ranks.world:
        raise ValueError(f"data.batch_size {batch_size} (the global micro-batch) does not split over {ranks.world} "
                         f"ranks: make it a multiple of {ranks.world}, each rank then takes "
                         f"batch_size / {ranks.world} rows of every micro-batch")


def shared_memory_free() -> int:
    """Free bytes of the shared-memory file system the host store goes to."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def part(numel: int, parts: int, index: int) -> tuple[int, int, int]:
    """The elements [lo, hi) of a tile of `numel` that part `index` of `parts` owns, and the padded
    part size every part has in the reduce-scatter (ALIGN-element multiples: aligned views)."""
    size = -(-numel // (parts * ALIGN)) * ALIGN
    lo = min(numel, index * size)
    return lo, min(numel, lo + size), size


def slab_numel(layer_numel: int, parts: int) -> int:
    """A gradient slab's elements: the largest part of a layer that a rank returns (the first),
    the whole layer on one rank."""
    lo, hi, _ = part(layer_numel, parts, 0)
    return hi - lo


def slab_pieces(numel: int, slab: int) -> int:
    """The pieces, a slab each, in which a rank returns `numel` elements of a tile's gradient (an
    empty part: one empty piece)."""
    return max(1, -(-numel // slab))


def shard_rows(tensor: torch.Tensor | None, ranks: Ranks) -> torch.Tensor | None:
    """Rows rank, rank + world, ... of a [B, S] tensor: this rank's slice of a global micro-batch."""
    return None if tensor is None else tensor[ranks.rank:: ranks.world]


def shard_batch(batch: Batch, ranks: Ranks) -> Batch:
    """This rank's rows of a global micro-batch, every field split alike (`shard_rows`): what
    MegaTrain's trainer and the data-parallel baselines compute on."""
    if not ranks.distributed:
        return batch
    return Batch(*(shard_rows(t, ranks) for t in (batch.input_ids, batch.labels, batch.attention_mask,
                                                  batch.position_ids)))


class SharedArena:
    """One host's store in one shared-memory file: page-aligned blocks handed out in order.

    Local rank 0 creates the file; the others map it once it exists; once all have mapped it, it is
    unlinked (the mappings stay), so nothing is left behind whatever way the run ends."""

    def __init__(self, nbytes: int, name: str, comm: "Comm"):
        self.path = SHM_DIR / name
        self.nbytes = -(-nbytes // PAGE) * PAGE
        try:
            if comm.ranks.local_rank == 0:
                self.memory = torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
            comm.barrier()
            if comm.ranks.local_rank != 0:
                self.memory = torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
            comm.barrier()
        finally:
            if comm.ranks.local_rank == 0:
                self.path.unlink(missing_ok=True)
        self.cursor = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """The next page-aligned block of `nbytes` (each process registers the pinned ones with
        CUDA itself: store.Blocks)."""
        start = self.cursor
        self.cursor += -(-nbytes // PAGE) * PAGE
        if self.cursor > self.nbytes:
            raise AssertionError(f"the shared store needs more than its {self.nbytes} bytes")
        return self.memory[start: start + nbytes]


class Flags:
    """Per tile and local rank, the updates that rank has published (int64 in the shared file).

    A writer bumps its counter after its part of the tile (master, moments, shadow) is written and
    before it sets the tile's own `ready`; a reader, once its own part is ready, waits until every
    local rank's counter has reached its own. The counters are read and written as sequentially
    consistent atomics (libatomic): the shadow's bytes are visible to another process before the
    counter that announces them, on aarch64 (GH200) as on x86-64."""

    def __init__(self, counters: torch.Tensor, names: list[str], local_rank: int):
        self.counters = counters.view(torch.int64).view(len(names), -1)  # [tile, local rank]
        self.index = {name: k for k, name in enumerate(names)}
        self.local_rank = local_rank
        self._base = self.counters.data_ptr()
        self._width = self.counters.shape[1]
        self._load, self._store = _atomics()

    @staticmethod
    def nbytes(tiles: int, local_world: int) -> int:
        return tiles * local_world * 8

    def _at(self, name: str, rank: int) -> int:
        return self._base + 8 * (self.index[name] * self._width + rank)

    def mark(self, name: str) -> None:
        at = self._at(name, self.local_rank)
        self._store(at, self._load(at, _SEQ_CST) + 1, _SEQ_CST)

    def ready(self, name: str) -> bool:
        """Every local rank has published as many updates of the tile as this one."""
        own = self._load(self._at(name, self.local_rank), _SEQ_CST)
        return all(self._load(self._at(name, r), _SEQ_CST) >= own for r in range(self._width))

    def wait(self, name: str) -> None:
        while not self.ready(name):
            time.sleep(POLL_S)


@functools.cache
def _atomics():
    """libatomic's 8-byte load and store (getattr: a name with two leading underscores); loaded
    by the first Flags, so a single-rank run does not need the library."""
    lib = ctypes.CDLL("libatomic.so.1")
    load, store = getattr(lib, "__atomic_load_8"), getattr(lib, "__atomic_store_8")
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    store.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    return load, store

_SEQ_CST = 5  # __ATOMIC_SEQ_CST


class Comm:
    """The collectives of a step: the gradient reduction, the step's sums, barriers."""

    def __init__(self, ranks: Ranks, local=None, cross=None, device: torch.device = torch.device("cpu")):
        self.ranks = ranks
        self.local, self.cross = local, cross  # this host's ranks; the same local rank on every host
        self.device = device  # where the collectives' tensors live (NCCL: the GPU)

    @staticmethod
    def single() -> "Comm":
        return Comm(Ranks())

    @staticmethod
    def init(ranks: Ranks, device: torch.device) -> "Comm":
        """Join the process group (NCCL on GPUs, gloo on the CPU) and build the host groups."""
        if not ranks.distributed:
            return Comm.single()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    device_id=device if device.type == "cuda" else None)
        if dist.get_world_size() != ranks.world:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks, WORLD_SIZE says {ranks.world}")
        # every rank names its host: the groups follow what torchrun assigned, not a rank formula
        where: list = [None] * ranks.world
        dist.all_gather_object(where, (ranks.node, ranks.local_rank))
        local = cross = None
        for node in sorted({n for n, _ in where}):  # every rank creates every group, in one order
            members = [r for r, (n, _) in enumerate(where) if n == node]
            group = dist.new_group(members)
            if node == ranks.node:
                local = group
        for lr in range(ranks.local_world):
            members = [r for r, (_, k) in enumerate(where) if k == lr]
            group = dist.new_group(members)
            if lr == ranks.local_rank:
                cross = group
        return Comm(ranks, local, cross, device)

    @property
    def distributed(self) -> bool:
        return self.ranks.distributed

    def run_name(self) -> str:
        """A name for this run's shared files, the same on every rank."""
        name = [f"megatrain-{os.getpid()}-{uuid.uuid4().hex[:12]}"]
        if self.distributed:
            dist.broadcast_object_list(name, src=0)
        return f"{name[0]}-host{self.ranks.node}"

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place, over every rank."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def sum_values(self, *values: float) -> list[float]:
        """Host numbers summed over every rank (through the collectives' device: NCCL takes no
        host tensor); a host sync."""
        if not self.distributed:
            return list(values)
        return self.sum(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def sum_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place, over this host's ranks (the owners of a tile's parts)."""
        if self.distributed and self.ranks.local_world > 1:
            dist.all_reduce(tensor, group=self.local)
        return tensor

    def reduce_part(self, grad: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """The summed gradient, over every rank, of this rank's part of a tile's gradient `grad`:
        (the part, lo, hi) with part[: hi - lo] its elements [lo, hi). A reduce-scatter among the
        host's ranks, then an all-reduce of the part among the hosts."""
        r = self.ranks
        if not self.distributed:
            return grad, 0, grad.numel()
        lo, hi, size = part(grad.numel(), r.local_world, r.local_rank)
        if r.local_world > 1:
            padded = grad if size * r.local_world == grad.numel() else \
                torch.nn.functional.pad(grad, (0, size * r.local_world - grad.numel()))
            out = torch.empty(size, dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, padded, group=self.local)
        else:
            out = grad.clone()
        if r.nodes > 1:
            dist.all_reduce(out, group=self.cross)
        return out, lo, hi

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
