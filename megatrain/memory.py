"""Memory admission: the host and device bytes a run needs, computed before anything is allocated.

The host side is exact for the store (the same arithmetic as the allocation, pinned buffers at the
power-of-two size torch's pinned allocator gives them) plus the slabs and staging; the device side is an estimate of the streaming buffers, the head's chunk, the
checkpoints and one block's activations, with a fixed workspace margin. A run that does not fit
stops with both numbers and what to change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import psutil
import torch

from megatrain.arch import Architecture
from megatrain.config import EngineConfig
from megatrain.store import HostStore, Layout, check_device_tiles, pinned_bytes

GiB = 1 << 30
HOST_OVERHEAD = 2 * GiB  # interpreter, torch, CUDA context on the host side
DEVICE_WORKSPACE = 2 * GiB  # cuBLAS/SDPA workspaces and allocator slack
# a decoder layer's saved activations outside the MLP, in hidden-size tensors of the compute dtype per
# token: 6.4 measured for the 7B shape on the CPU, with its input and the lean norms (lean_norm.py)
ATTN_KEPT = 7


@dataclass
class MemoryPlan:
    host_bytes: int
    device_bytes: int
    detail: dict[str, int]
    clipping: bool  # the store keeps a float32 gradient per parameter


def _chunk(cfg: EngineConfig) -> int | None:
    """The MLP chunk a plan counts (`auto` not yet resolved counts as the whole MLP)."""
    return cfg.mlp_chunk_tokens if isinstance(cfg.mlp_chunk_tokens, int) else None


def _kept(cfg: EngineConfig) -> int:
    """The layers a plan counts as not recomputed (`auto` not yet resolved counts as none)."""
    return cfg.no_recompute_layers if isinstance(cfg.no_recompute_layers, int) else 0


def _tiles(cfg: EngineConfig) -> int:
    """The device tiles a plan counts (`auto` not yet resolved counts as none)."""
    return cfg.device_tiles if isinstance(cfg.device_tiles, int) else 0


def check_no_recompute(arch: Architecture, n: int | str) -> None:
    if n != "auto" and n > arch.num_layers:
        raise ValueError(f"engine.no_recompute_layers must be at most the model's {arch.num_layers} layers, not {n}")


def plan(arch: Architecture, cfg: EngineConfig, master: torch.dtype, compute: torch.dtype,
         tokens: int, microbatches: int, clipping: bool, pinned: bool = False) -> MemoryPlan:
    """Bytes needed to train `arch` on steps of `microbatches` micro-batches of `tokens` tokens
    (`pinned`: the host buffers the device copies from are pinned, as with a GPU)."""
    c, M = compute.itemsize, microbatches
    h, v, L, K = arch.hidden, arch.vocab, arch.num_layers, cfg.checkpoint_every
    layer = Layout.of(arch.layer_specs).numel
    head = Layout.of(arch.head_specs).numel + (v * h if arch.tied else 0)
    unit = max(layer, head)
    ffn = getattr(arch.config, "intermediate_size", 4 * h)
    T = _tiles(cfg)
    check_device_tiles(arch, T)
    check_no_recompute(arch, cfg.no_recompute_layers)
    N, chunk_mlp = _kept(cfg), _chunk(cfg)
    blocks = -(-(L - N) // K)  # the recomputed blocks, each with a checkpoint
    store_host, store_device = HostStore.nbytes(arch, master, compute, clipping, T, pinned)
    host = {
        "store": store_host,
        "grad_slabs": max(1, cfg.grad_slabs) * pinned_bytes(layer * 4, pinned),
        "embedding_staging": pinned_bytes(tokens * h * c, pinned),
        "checkpoint_offload": (blocks * M * pinned_bytes(tokens * h * c, pinned)) if cfg.offload_checkpoints else 0,
        "runtime": HOST_OVERHEAD,
    }
    chunk = min(cfg.loss_chunk_tokens, tokens)
    device = {
        "weight_buffers": cfg.weight_buffers * unit * c,
        # float32 step gradients: a block's K layers' plus one still returning, and the head's;
        # untied, also the embedding's (kept through the backward for its rows)
        "grad_accumulators": ((K + 1) * layer + head + (0 if arch.tied else v * h)) * 4,
        "layer_grads": layer * c,  # autograd's per-parameter gradients of one layer
        "head_chunk": chunk * v * (4 + 4 + c),  # logits, their float32 copy and gradient
        # block inputs of every micro-batch (two blocks when offloaded), plus the hidden states
        # and their gradients in flight
        "checkpoints": ((min(2, blocks) if cfg.offload_checkpoints else blocks) + 2) * M * tokens * h * c,
        # what one layer's graph keeps, per token: ATTN_KEPT h (its input, the norms' outputs, q before
        # and after rotary, attention out and its copy, the residual sum) and the MLP's 4 of width ffn
        # (chunked: the MLP's only for one chunk, in its backward)
        "block_activations": K * (tokens * ATTN_KEPT * h + min(tokens, chunk_mlp or tokens) * 4 * ffn) * c,
        # the graphs of the layers not recomputed, every micro-batch's, from their forward to their
        # backward (a chunked MLP keeps only its input, counted within ATTN_KEPT h)
        "kept_graphs": N * M * tokens * (ATTN_KEPT * h + (0 if chunk_mlp else 4 * ffn)) * c,
        # a layer's backward beyond its graph: gradients through the rotary embedding and attention,
        # flash attention's float32 dq accumulator (the norms' temporaries are chunked: lean_norm.py)
        "backward_temporaries": 4 * tokens * h * c,
        "workspace": DEVICE_WORKSPACE,
        # master and moments of the device tiles; with clipping their layers' step gradients wait
        # for the global norm
        "device_tiles": store_device + (max(0, T - 1) * layer * 4 if clipping else 0),
    }
    return MemoryPlan(sum(host.values()), sum(device.values()),
                      {**host, **{"device." + k: b for k, b in device.items()}}, clipping)


MLP_CHUNKS = (65536, 32768, 16384, 8192, 4096)


def choose_mlp_chunk(arch: Architecture, cfg: EngineConfig, master: torch.dtype, compute: torch.dtype,
                     tokens: int, microbatches: int, clipping: bool, device_available: int | None,
                     pinned: bool = False) -> int | None:
    """`engine.mlp_chunk_tokens: auto`: the whole MLP when the plan fits the device (or nothing bounds
    it), else the largest chunk of MLP_CHUNKS that makes it fit, else the smallest (admission then
    refuses with the numbers). Chunking recomputes part of the MLP: it is chosen only when needed."""
    def fits(chunk: int | None) -> bool:
        p = plan(arch, replace(cfg, mlp_chunk_tokens=chunk), master, compute, tokens, microbatches, clipping, pinned)
        return device_available is None or p.device_bytes <= device_available
    if fits(None):
        return None
    candidates = [c for c in MLP_CHUNKS if c < tokens]
    return next((c for c in candidates if fits(c)), candidates[-1] if candidates else None)


def _most_that_fit(field: str, count: int, arch: Architecture, cfg: EngineConfig, master: torch.dtype,
                   compute: torch.dtype, tokens: int, microbatches: int, clipping: bool,
                   device_available: int | None, pinned: bool) -> int:
    """The largest n in 1..count for which the plan with engine.<field> = n fits the device with
    DEVICE_WORKSPACE spare once more, else 0; 0 when nothing bounds memory (the CPU)."""
    if device_available is None:
        return 0
    def fits(n: int) -> bool:
        p = plan(arch, replace(cfg, **{field: n}), master, compute, tokens, microbatches, clipping, pinned)
        return p.device_bytes + DEVICE_WORKSPACE <= device_available
    return next((n for n in range(count, 0, -1) if fits(n)), 0)


def choose_device_tiles(arch: Architecture, cfg: EngineConfig, master: torch.dtype, compute: torch.dtype,
                        tokens: int, microbatches: int, clipping: bool, device_available: int | None,
                        pinned: bool = False) -> int:
    """`engine.device_tiles: auto`: the most tiles, in forward order, whose master and moments (and,
    with clipping, step gradients) the device holds beside everything else the plan counts.
    Chosen before the layers kept from recompute: where the GPU's step is shorter than the CPU's
    AdamW (small models, few tokens per step) the updates left on the host are exposed time, which
    recompute is not."""
    return _most_that_fit("device_tiles", arch.num_layers + 1, arch, cfg, master, compute, tokens, microbatches,
                          clipping, device_available, pinned)


def choose_no_recompute(arch: Architecture, cfg: EngineConfig, master: torch.dtype, compute: torch.dtype,
                        tokens: int, microbatches: int, clipping: bool, device_available: int | None,
                        pinned: bool = False) -> int:
    """`engine.no_recompute_layers: auto`: the most layers (from the last) whose graphs the device
    holds beside everything else the plan counts (the graphs are an estimate, and an over-estimate
    costs only speed)."""
    return _most_that_fit("no_recompute_layers", arch.num_layers, arch, cfg, master, compute, tokens,
                          microbatches, clipping, device_available, pinned)


def admit(p: MemoryPlan, host_available: int, device_available: int | None) -> None:
    """Raise ValueError, with the numbers and what to change, when the plan does not fit."""
    problems = []
    if p.host_bytes > host_available:
        problems.append(
            f"host memory: needs {p.host_bytes / GiB:.1f} GiB, {host_available / GiB:.1f} GiB available "
            f"(store {p.detail['store'] / GiB:.1f} GiB, gradient slabs {p.detail['grad_slabs'] / GiB:.1f} GiB; "
            + ("clipping keeps a float32 gradient per parameter, optim.max_grad_norm=null saves 4 bytes per "
               "parameter; " if p.clipping else "")
            + "fewer engine.grad_slabs (each holds one layer's float32 gradient), engine.master_dtype=bfloat16, "
            "a smaller model, or state engine.host_memory_gb if the OS under-reports it)")
    if device_available is not None and p.device_bytes > device_available:
        acts = sum(p.detail[f"device.{k}"] for k in ("block_activations", "checkpoints", "kept_graphs"))
        problems.append(
            f"device memory: needs about {p.device_bytes / GiB:.1f} GiB, {device_available / GiB:.1f} GiB free "
            f"(activations {acts / GiB:.1f} GiB; lower data.batch_size, data.grad_accum or data.seq_len, "
            f"engine.checkpoint_every, engine.loss_chunk_tokens, engine.mlp_chunk_tokens or "
            f"engine.no_recompute_layers, or set engine.offload_checkpoints)")
    if problems:
        raise ValueError("the run does not fit: " + "; ".join(problems))


def host_available_bytes(stated_gb: float | None) -> int:
    if stated_gb is not None:
        return int(stated_gb * GiB)
    return psutil.virtual_memory().available
