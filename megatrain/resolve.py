"""From what the user asked to what a run does: every `auto` setting decided, once, up front.

`resolve(engine, data, optim, shape, machine)` takes the user's engine settings, the model's
shape and the machine's free memory and returns frozen EngineSettings; the memory plan, the store
and the engine read only those. The `auto` choices are made in this order, each with the ones
before it settled:
  the kernels          each its own kernel where it can run for this model on this machine (on a
                       GPU, but the host AdamW's: kernels.py), else the library's ops
  mlp_chunk_tokens     the whole MLP when the plan fits the device, else the largest chunk of
                       MLP_CHUNKS that makes it fit (chunking recomputes part of the MLP)
  device_tiles         the most tiles, in forward order, whose optimizer state the device holds
                       beside everything else (their updates are the ones the next step waits for
                       on the host), first, but where recomputing the attention costs the step more
                       than those updates (long sequences: _attention_first); then last
  no_recompute_layers  the most layers, from the last, whose forward graphs the device holds
  keep_attention_layers  the most recomputed layers, from the last that can (kept_attention.py),
                       whose attention output the device holds from the forward to the backward
                       (offloaded: two blocks' of it, and the host every layer's, so as many as fit both):
                       after the graphs, which save the whole recompute of a layer, not a part
                       (where the attention comes first, also before them: a kept attention saves
                       most of a long sequence's recompute in a small part of its graph's bytes)
  split_masters        float32 masters held split (12 B/param on the host instead of 14) wherever the
                       host's one-pass AdamW kernel runs (optimizer_kernel compiled): it moves 28 bytes
                       a parameter split against 30 whole, torch's fused AdamW's own 28 (docs/host-store.md);
                       with the eager update, 2-4x slower split on the CPU, only when the 14-byte plan
                       does not fit the host and the 12-byte one does (decided with 4 gradient slabs
                       where those are auto, with 2 where neither plan fits with 4)
  grad_slabs           8 where the plan with 8 fits the host, else 4, else 2 (admission then refuses
                       if 2 do not fit, naming the slabs), and never more than the gradient pieces a
                       rank returns to the host in a step (a shallow model of wide layers: GPT-OSS-120B
                       on 3 layers returns 3 pieces of 13 GB, which 3 slabs hold as well as 8 would):
                       past 4, the launching thread queues further ahead of a host AdamW slower than
                       the backward (7B at 4 x 4096 on the H100: 0.861 -> 0.925 of the layer ceiling
                       with 8), and the optimizer can leave more of the last layers' pieces for the
                       next forward to overlap (host_executor.py), for a layer's float32 gradient of
                       pinned host memory each; with clipping the setting allocates none (each tile's
                       gradient returns into its own buffer: the plan counts no slabs)
The device choices leave DEVICE_WORKSPACE spare once more: their graphs and states are estimates,
and an over-estimate costs only speed. With no device bound (the CPU) they choose 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import os

import psutil
import torch

from megatrain import fused_adamw, memory, metrics, schedule
from megatrain.config import DataConfig, EngineConfig, EngineSettings, OptimConfig
from megatrain.distributed import Ranks, check as check_ranks, slab_numel, slab_pieces
from megatrain.kernels import KERNELS, OPTIMIZER
from megatrain.shapes import ModelShape
from megatrain.store import Layout
from megatrain.units import GiB

MLP_CHUNKS = (65536, 32768, 16384, 8192, 4096)
GRAD_SLABS = (8, 4, 2)
HOST_MEMORY_ENV = "MEGATRAIN_HOST_MEMORY_GB"
# GPU FLOPs in the time the host's AdamW updates one parameter: a 7B layer's 505 TFLOP/s against the
# one-pass update's 3.5 G parameters a second, both on the lent one-GPU H200 (docs/decisions.md,
# "Kept attention before device tiles on long sequences")
DEVICE_FLOPS_PER_HOST_UPDATE = 1.5e5


def host_available_bytes(stated_gb: float | None = None) -> int:
    """The host memory a run may use: as stated (engine.host_memory_gb, else the environment's
    MEGATRAIN_HOST_MEMORY_GB, which the harness's baselines read too), else what the OS calls
    available now. Some VMs grow MemTotal as memory is used (one lent host reads 31 of its 256 GiB
    at start): there, state it."""
    if stated_gb is None and os.environ.get(HOST_MEMORY_ENV):
        try:
            stated_gb = float(os.environ[HOST_MEMORY_ENV])
        except ValueError:
            raise ValueError(f"{HOST_MEMORY_ENV} must be a number of GiB, not {os.environ[HOST_MEMORY_ENV]!r}") from None
        if not stated_gb > 0:
            raise ValueError(f"{HOST_MEMORY_ENV} must be positive, not {stated_gb}")
    if stated_gb is not None:
        return int(stated_gb * GiB)
    return psutil.virtual_memory().available


@dataclass(frozen=True)
class Machine:
    """What a run may use: the accelerator's free bytes (None: no bound, as on the CPU) and the host's."""
    is_cuda: bool
    device_free: int | None
    host_available: int
    gpus: int = 0  # on this host
    # why the host AdamW's compiled kernel cannot be had here (fused_adamw.probe); None where it
    # can, where the run asks for the eager update, or for a machine only stated
    host_adamw_why_not: str | None = None

    @staticmethod
    def of(device, engine: EngineConfig) -> "Machine":
        """This machine as `device` reports it, or as engine.device_memory_gb and the host memory
        stated (host_available_bytes) say; the host AdamW's kernel loaded from the per-user cache or
        built there (seconds) where the run may use it."""
        free = device.free_bytes()
        if engine.device_memory_gb is not None:
            free = int(engine.device_memory_gb * GiB)
        gpus = torch.cuda.device_count() if device.is_cuda else 0
        why_not = fused_adamw.probe() if engine.optimizer_kernel != OPTIMIZER.library else None
        return Machine(device.is_cuda, free, host_available_bytes(engine.host_memory_gb), gpus, why_not)


def resolve(engine: EngineConfig, data: DataConfig, optim: OptimConfig, shape: ModelShape,
            machine: Machine, ranks: Ranks = Ranks(), data_bytes: int = 0) -> EngineSettings:
    """`ranks`: data-parallel ranks split each micro-batch's rows (data.batch_size is global) and
    share one host store per host (distributed.py). `data_bytes`: the tokenised examples the host
    holds beside the plan (memory.plan)."""
    _check_against_shape(engine, shape)
    check_ranks(ranks, data.batch_size, "cuda" if machine.is_cuda else "cpu", machine.gpus)
    compute = engine.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if machine.is_cuda else "float32"
    splittable = engine.master_dtype == "float32" and compute == "bfloat16"  # store.can_split
    if engine.split_masters is True and not splittable:  # asked for, it would do nothing
        why = ("with engine.master_dtype bfloat16 there are no float32 masters to split: set engine.master_dtype "
               "float32" if engine.master_dtype != "float32" else
               f"this run computes in {compute}" + (" (a CPU run's auto compute_dtype)" if engine.compute_dtype == "auto"
                                                    else "") + ", so there is no bfloat16 copy to split into: set "
               "engine.compute_dtype bfloat16")
        raise ValueError(f"engine.split_masters: true holds float32 masters as their bfloat16 compute copy plus "
                         f"the low 16 bits; {why}, or leave engine.split_masters auto")
    chosen: dict[str, str] = {}
    for kernel in KERNELS:
        chosen[kernel.setting] = kernel.choose(getattr(engine, kernel.setting), shape, machine, chosen)
    auto_split = engine.split_masters == "auto" and chosen[OPTIMIZER.setting] == OPTIMIZER.own
    split = splittable and (engine.split_masters is True or auto_split)  # auto: half a load's bytes, the update one pass
    s = EngineSettings(
        device=engine.device, compute_dtype=compute, master_dtype=engine.master_dtype,
        split_masters=split,
        checkpoint_every=engine.checkpoint_every, weight_buffers=engine.weight_buffers,
        offload_checkpoints=engine.offload_checkpoints,
        grad_slabs=4 if engine.grad_slabs == "auto" else engine.grad_slabs,  # auto's capped below, by the pieces
        device_tiles=0 if engine.device_tiles == "auto" else engine.device_tiles,
        loss_chunk_tokens=engine.loss_chunk_tokens,
        mlp_chunk_tokens=None if engine.mlp_chunk_tokens == "auto" else engine.mlp_chunk_tokens,
        no_recompute_layers=0 if engine.no_recompute_layers == "auto" else engine.no_recompute_layers,
        keep_attention_layers=0, offloaded_attention_layers=0,
        optimizer_threads=engine.optimizer_threads, **chosen, timeline=engine.timeline,
        tokens=data.batch_size // ranks.world * data.seq_len, seq_len=data.seq_len, microbatches=data.grad_accum,
        clipping=optim.max_grad_norm is not None, pinned=machine.is_cuda, ranks=ranks.world,
        local_ranks=ranks.local_world)
    bound = machine.device_free
    if engine.mlp_chunk_tokens == "auto" and shape.gated_mlp:
        s = replace(s, mlp_chunk_tokens=_mlp_chunk(shape, s, bound))
    attention_first = bound is not None and _attention_first(shape, s)
    if engine.device_tiles == "auto" and not attention_first:
        s = replace(s, device_tiles=_most_that_fit(shape, s, "device_tiles", shape.num_layers + 1, bound))
    host = (machine.host_available, data_bytes)
    if attention_first and engine.keep_attention_layers == "auto":
        s = _keep_attention(engine, shape, s, bound, host)
    if engine.no_recompute_layers == "auto":
        s = replace(s, no_recompute_layers=_most_that_fit(shape, s, "no_recompute_layers", shape.num_layers, bound))
    s = _keep_attention(engine, shape, s, bound, host)
    if engine.device_tiles == "auto" and attention_first:
        s = replace(s, device_tiles=_most_that_fit(shape, s, "device_tiles", shape.num_layers + 1, bound))
    if engine.grad_slabs == "auto":  # after device_tiles: the host tiles' pieces
        s = replace(s, grad_slabs=min(s.grad_slabs, _pieces(shape, s)))
    if engine.grad_slabs == "auto":
        s = replace(s, grad_slabs=min(_slabs(shape, s, machine.host_available, data_bytes), _pieces(shape, s)))
    return s


def _keep_attention(engine: EngineConfig, shape: ModelShape, s: EngineSettings, bound: int | None,
                    host: tuple[int, int]) -> EngineSettings:
    """keep_attention_layers: as many as the device holds (auto) or as asked, at most the recomputed
    layers that can. With offload_attention, those the device does not hold keep it in host memory
    (offloaded_attention_layers), the device holding two blocks' of them in flight: auto adds as many
    as the device and the host (`host`: its available bytes and the data's) hold; asked for, all of
    the number, the most of them on the device that leaves room for the rest's blocks (where none
    does, as many as the device holds alone)."""
    keepable = len(schedule.layers_keeping_attention(shape, s.seq_len, s.no_recompute_layers, shape.num_layers))
    asked = keepable if engine.keep_attention_layers == "auto" else min(engine.keep_attention_layers, keepable)
    on_device = _most_that_fit(shape, replace(s, offloaded_attention_layers=0), "keep_attention_layers", asked, bound)
    if engine.keep_attention_layers != "auto" and not engine.offload_attention:
        return replace(s, keep_attention_layers=asked, offloaded_attention_layers=0)
    if not engine.offload_attention:
        return replace(s, keep_attention_layers=on_device, offloaded_attention_layers=0)
    available, data_bytes = host

    def fits(device: int, extra: int, on_host: bool = True) -> bool:
        p = memory.plan(shape, replace(s, keep_attention_layers=device + extra, offloaded_attention_layers=extra),
                        data_bytes)
        return p.device_bytes + memory.DEVICE_WORKSPACE <= bound and (not on_host or p.host_bytes <= available)
    if engine.keep_attention_layers != "auto":
        device = next((d for d in range(on_device, -1, -1) if bound is not None and fits(d, asked - d, on_host=False)),
                      on_device)
        return replace(s, keep_attention_layers=asked, offloaded_attention_layers=asked - device)
    if bound is None:
        return replace(s, keep_attention_layers=0, offloaded_attention_layers=0)
    # the offloaded layers' two blocks in flight may need the room of as many kept on the device
    best = (on_device, 0)
    for device in range(on_device, max(0, on_device - 2 * s.checkpoint_every) - 1, -1):
        extra = next((n for n in range(asked - device, 0, -1) if fits(device, n)), 0)
        if device + extra > sum(best):
            best = (device, extra)
    return replace(s, keep_attention_layers=sum(best), offloaded_attention_layers=best[1])


def _attention_first(shape: ModelShape, s: EngineSettings) -> bool:
    """Whether the device's room goes to kept attention before device tiles: where recomputing the
    attention of every layer that can keep it costs more GPU time than the host's update of the
    first two tiles (the embedding and layer 0), the part of the update a step's end waits for once
    the backward hides the rest, which is all that device tiles can save. Long sequences: the
    attention grows with the square of their length, the update not at all."""
    keepable = schedule.layers_keeping_attention(shape, s.seq_len, 0, shape.num_layers)
    lengths = [s.seq_len] * (s.tokens // s.seq_len) * s.microbatches
    recompute = metrics.attention_flops(shape.attention(keepable), lengths) / 2  # causal: half the scores
    first_tiles = sum(spec.numel for _, specs in shape.units()[:2] for spec in specs)
    return recompute > first_tiles * DEVICE_FLOPS_PER_HOST_UPDATE


def _check_against_shape(engine: EngineConfig, shape: ModelShape) -> None:
    L = shape.num_layers
    if isinstance(engine.device_tiles, int) and engine.device_tiles > L + 1:
        raise ValueError(f"engine.device_tiles must be between 0 and {L + 1} (the embedding and the {L} layers), "
                         f"not {engine.device_tiles}")
    if isinstance(engine.no_recompute_layers, int) and engine.no_recompute_layers > L:
        raise ValueError(f"engine.no_recompute_layers must be at most the model's {L} layers, "
                         f"not {engine.no_recompute_layers}")
    if isinstance(engine.mlp_chunk_tokens, int) and not shape.gated_mlp:  # the templates would refuse it, after allocating
        raise ValueError(f"engine.mlp_chunk_tokens chunks the bias-free SiLU-gated MLP; this {shape.family} model's "
                         f"is not, or its output is read by more than the residual sum (Gemma's post-feedforward "
                         f"norm): set engine.mlp_chunk_tokens: null")


def _mlp_chunk(shape: ModelShape, s: EngineSettings, device_free: int | None) -> int | None:
    def fits(chunk: int | None) -> bool:
        return device_free is None or memory.plan(shape, replace(s, mlp_chunk_tokens=chunk)).device_bytes <= device_free
    if fits(None):
        return None
    candidates = [c for c in MLP_CHUNKS if c < s.tokens]
    return next((c for c in candidates if fits(c)), candidates[-1] if candidates else None)


def _pieces(shape: ModelShape, s: EngineSettings) -> int:
    """The gradient pieces a rank returns to the host's AdamW in a step, each in a slab of its own
    (Engine._contributions): more slabs than these are never in use at once, since a step's forward
    waits for every update of the step before (at least 1)."""
    layer = max(Layout.of(specs).numel for specs in shape.layer_layouts)
    slab = slab_numel(layer, s.local_ranks)
    units = [Layout.of(specs).numel for _, specs in shape.units()][s.device_tiles:]
    return max(1, sum(slab_pieces(slab_numel(n, s.local_ranks), slab) for n in units))


def _slabs(shape: ModelShape, s: EngineSettings, host_available: int, data_bytes: int) -> int:
    """The most of GRAD_SLABS whose plan fits the host, else the fewest (admission then refuses, naming the slabs)."""
    def fits(n: int) -> bool:
        return memory.plan(shape, replace(s, grad_slabs=n), data_bytes).host_bytes <= host_available
    return next((n for n in GRAD_SLABS if fits(n)), GRAD_SLABS[-1])


def _most_that_fit(shape: ModelShape, s: EngineSettings, field: str, count: int, device_free: int | None) -> int:
    """The largest n in 1..count for which the plan with <field> = n fits the device with
    DEVICE_WORKSPACE spare once more, else 0; 0 when nothing bounds memory."""
    if device_free is None:
        return 0

    def fits(n: int) -> bool:
        return memory.plan(shape, replace(s, **{field: n})).device_bytes + memory.DEVICE_WORKSPACE <= device_free
    return next((n for n in range(count, 0, -1) if fits(n)), 0)
