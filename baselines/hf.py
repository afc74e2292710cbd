"""What the baselines share: the `transformers` model of a spec, its loss, its memory need, and
their data-parallel ranks (RunSpec.gpus under torchrun: each rank one GPU, rows rank, rank + N, ...
of every global micro-batch, as MegaTrain's ranks take them)."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatrain.distributed import Ranks, shard_batch
from megatrain.memory import DoesNotFit, Shortage
from megatrain.resolve import host_available_bytes
from megatrain.shapes import ModelShape
from megatrain.units import GiB

# A rank's own host memory beside its shard of the offloaded state (the CUDA context, the runtime's
# private pages, its staging buffers), for each rank beyond the first, whose share the measured
# per-parameter rates include: an estimate until the two-GPU runs measure it.
RANK_HOST_BYTES = 4 * GiB
# Disk a swapping baseline's run needs beside its swap (DeepSpeed's built ops, the run's log and
# result, the file system's own writes): ZeRO-Infinity at 7B on the x2 host, its swap's bound at
# 127.7 GiB of the 127.8 free, filled the disk in its first step.
DISK_RESERVE = 2 * GiB
# elements a thread draws at a time in normals_in_parallel: a 14B matrix is 18 of them or more
NORMAL_CHUNK = 1 << 22


class Laps:
    """Seconds of each named part of a system's set-up, in the order they ran (a result's
    info.setup_s, beside the worker's whole setup_s): which part a faster set-up has to shorten."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = now - self._last
        self._last = now


def build_model(spec, device: torch.device | str | None = None):
    """The spec's model in float32: random init from spec.seed, or a local pretrained checkpoint.
    With no `device` it is built where torch's defaults put it and never moved (a ZeRO-3 model,
    partitioned as it is built, must not be moved; `transformers` initialises it once itself).
    On the CPU (FSDP2's and Gemini's builds) the modules are built without torch's own init, which
    `transformers`' init (normal matrices, ones and zeros) overwrites anyway: one pass over the
    weights instead of two, a third less time (Qwen2.5-3B: 58.8 -> 38.7 s on 2 cores), the same
    distributions; and that pass draws its matrices on every thread (`normals_in_parallel`). On a
    GPU both passes take a few seconds, and the build is as `transformers` does it."""
    from transformers import AutoModelForCausalLM, initialization
    mc = spec.model_config()
    if mc.pretrained:
        model = AutoModelForCausalLM.from_pretrained(mc.pretrained, dtype=torch.float32,
                                                     attn_implementation=spec.hf_config()._attn_implementation)
        return model.to(device) if device is not None else model
    torch.manual_seed(spec.seed)
    if device is not None and torch.device(device).type == "cpu":
        with torch.device("cpu"):
            with initialization.no_init_weights():
                model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
            with normals_in_parallel():
                model.init_weights()
        return model
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)


@contextlib.contextmanager
def normals_in_parallel():
    """Within it, `transformers`' init draws each matrix (its `initialization.normal_`) on all of
    torch's threads, where torch's CPU normal_ takes one (14.8 B parameters in 95 s on the four-GPU
    host's 64 cores): in chunks of NORMAL_CHUNK elements, each from its own generator, seeded from the
    default one, so that a seed builds the same weights whatever the thread count. Each draw ends
    before the init goes on: what the init writes afterwards (an embedding's padding row) stays."""
    from megatrain.store import in_parallel
    from transformers import initialization
    draw, chunk = initialization.normal_, NORMAL_CHUNK

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        if (generator is not None or getattr(tensor, "_is_hf_initialized", False) or not tensor.is_contiguous()
                or tensor.device.type != "cpu" or tensor.numel() < 2 * chunk):
            return draw(tensor, mean=mean, std=std, generator=generator)
        base = int(torch.randint(1 << 62, ()))

        def fill(i: int, part: torch.Tensor) -> None:
            part.normal_(mean, std, generator=torch.Generator().manual_seed(base + i))
        in_parallel(fill, list(enumerate(tensor.detach().view(-1).split(chunk))))
        return tensor
    initialization.normal_ = normal_
    try:
        yield
    finally:
        initialization.normal_ = draw


def enable_checkpointing(model) -> None:
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def params(spec) -> int:
    return ModelShape(spec.hf_config()).total_params()


def host_need(spec, bytes_per_param: float, rank_bytes_per_param: float = 0.0) -> tuple[int, str]:
    """Host bytes of a point on spec.gpus = N ranks, and what they are made of. `bytes_per_param`:
    the whole host state of one process, measured on one GPU; FSDP2 and ZeRO-3 shard that state
    over their ranks, so it stays whatever N, and each rank beyond the first adds its own
    `rank_bytes_per_param` (what it holds of the whole model) and RANK_HOST_BYTES (its runtime)."""
    n, p = spec.gpus, params(spec)
    need = p * bytes_per_param + (n - 1) * (p * rank_bytes_per_param + RANK_HOST_BYTES)
    how = f"{bytes_per_param} B/param x {p / 1e9:.2f} B params"
    if n > 1:
        how += (f", sharded over {n} ranks, + {n - 1} further rank(s) at {rank_bytes_per_param} B/param and "
                f"{RANK_HOST_BYTES / GiB:.0f} GiB each")
    return int(need), how


def require_host(spec, bytes_per_param: float, what: str, rank_bytes_per_param: float = 0.0,
                 ranks: Ranks = Ranks()) -> None:
    """Refuse before allocating when the host cannot hold the point (`host_need`; the rates are
    measured figures of each system); `options.admission: false` tries anyway. Every rank decides
    on the first rank's reading of the available memory, so that all refuse or none."""
    if not spec.options.get("admission", True):
        return
    need, how = host_need(spec, bytes_per_param, rank_bytes_per_param)
    have = agreed(ranks, host_available_bytes())  # as stated (MEGATRAIN_HOST_MEMORY_GB) where the OS under-reports
    if need > have:
        raise DoesNotFit(what, [Shortage("host", need, have, how)])


def require_disk(what: str, n_params: int, bytes_per_param: float, path: str, ranks: Ranks = Ranks()) -> None:
    """Refuse before the swap is made when the disk of `path` (or of its nearest existing folder)
    cannot hold it (`bytes_per_param`: each system's bound) and DISK_RESERVE; every rank decides on
    the first rank's reading."""
    need = int(n_params * bytes_per_param + DISK_RESERVE)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = agreed(ranks, shutil.disk_usage(existing).free)
    if need > free:
        raise DoesNotFit(what, [Shortage("disk", need, free, f"its swap at {path}, {bytes_per_param} B/param x "
                                         f"{n_params / 1e9:.2f} B params, + {DISK_RESERVE / GiB:.0f} GiB "
                                         f"for the run's other files")])


def require_device(spec, device: torch.device, count: Callable[[], tuple[int, str]], what: str,
                   ranks: Ranks = Ranks()) -> None:
    """Refuse before allocating when the device's free memory cannot hold the point: `count()` gives
    its bytes (a rank's) and what they are made of (counted only on a GPU); `options.admission:
    false` tries anyway. Every rank decides on the first rank's reading, so that all refuse or none."""
    if device.type != "cuda" or not spec.options.get("admission", True):
        return
    need, how = count()
    free = agreed(ranks, torch.cuda.mem_get_info(device)[0])
    if need > free:
        raise DoesNotFit(what, [Shortage("device", int(need), free, how)])


def adamw_params(model, weight_decay: float) -> list:
    """The model's parameters for AdamW. With weight decay, two groups: decay on matrices only, as
    MegaTrain applies it (megatrain.shapes.ParamSpec.decay); without, the plain list."""
    params = list(model.parameters())
    if not weight_decay:
        return params
    # a ZeRO-3 parameter is a flat shard by now; DeepSpeed keeps its own shape as ds_shape
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    return [{"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay},
            {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}]


def adamw_kwargs(spec) -> dict:
    """The spec's AdamW settings, for torch.optim.AdamW and the optimizers that take its arguments."""
    return dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def loss_of(model, batch, device: torch.device, autocast: bool):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=batch.input_ids.to(device, non_blocking=True),
                     labels=batch.labels.to(device, non_blocking=True)).loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, microbatches, device: torch.device, autocast: bool, ranks: Ranks = Ranks(),
               before: Callable[[bool], None] | None = None) -> dict:
    """One optimizer step of a plain torch model over the (global) micro-batches, each rank on its
    rows of each (the data-parallel wrapper averages the gradients over the ranks); the mean loss.
    `before(last)` runs before each micro-batch, told whether it is the step's last."""
    total = torch.zeros((), device=device)
    for i, batch in enumerate(microbatches):
        if before is not None:
            before(i == len(microbatches) - 1)
        loss = loss_of(model, shard_batch(batch, ranks), device, autocast)
        (loss / len(microbatches)).backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(device)
    return {"loss": mean_over_ranks(total, ranks) / len(microbatches)}


def mean_over_ranks(value: torch.Tensor, ranks: Ranks) -> float:
    """A per-rank number (a loss over the rank's rows) averaged over the ranks: the global step's,
    as the rows split evenly; a host sync."""
    if ranks.distributed:
        dist.all_reduce(value)
        value = value / ranks.world
    return value.item()


def agreed(ranks: Ranks, value: Any) -> Any:
    """The first rank's `value` on every rank: a reading each rank would take at its own instant
    (free host memory, free disk) decides alike everywhere, so no rank refuses alone and leaves the
    others waiting in a collective."""
    if not ranks.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def join(device: torch.device) -> Ranks:
    """This process's ranks, the default process group joined: torchrun's ranks (each on the GPU of
    its LOCAL_RANK, made current: FSDP and NCCL take the current device), or a one-process group on
    a free port, given to the group and not to the environment (a later run in this process, or a
    process started from it, would inherit a port that another process may hold by then). NCCL on
    GPUs, gloo on the CPU."""
    ranks = Ranks.from_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        single = {} if ranks.distributed else dict(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None, **single)
    return ranks


def free_port() -> int:
    """A free TCP port on this host, for a one-process 'distributed' group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
