"""Memory admission: the host and device bytes a run needs, computed before anything is allocated.

The host side is exact for the store (the same arithmetic as the allocation: its pinned shadows are
registered at their exact size, store.Blocks) plus the slabs and staging (pinned by torch's
allocator, at the power of two it rounds them up to); the device side is an estimate of the streaming buffers, the head's chunk, the
checkpoints and one block's activations, with a fixed workspace margin. A run that does not fit
stops with both numbers and what to change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatrain import kept_attention, schedule
from megatrain.config import EngineSettings
from megatrain.distributed import slab_numel
from megatrain.kernels import MLP
from megatrain.shapes import ModelShape
from megatrain.adamw import SCRATCH_BYTES
from megatrain.buffers import STAGE
from megatrain.store import PAGE, HostStore, Layout, pinned_bytes
from megatrain.units import GiB

HOST_OVERHEAD = 2 * GiB  # interpreter, torch, CUDA context on the host side
DEVICE_WORKSPACE = 2 * GiB  # cuBLAS/SDPA workspaces and allocator slack
# a decoder layer's saved activations outside the MLP, in hidden-size tensors of the compute dtype per
# token: 6.4 measured for the 7B shape on the CPU, with its input and the lean norms (lean_norm.py)
ATTN_KEPT = 7
# the same, measured likewise (saved-tensor hooks on one layer of the published shape, SDPA
# attention), where a family keeps more: Phi-3-mini 9.1 (its fused qkv output, full-width k and v),
# Gemma 2 9B 9.6 (its post-attention and post-feedforward norms keep their inputs), a Gemma 3 12B
# layer 13.1 (its q and k norms too)
FAMILY_ATTN_KEPT = {"phi3": 10, "gemma2": 10, "gemma3_text": 14}


@dataclass
class MemoryPlan:
    host_bytes: int
    device_bytes: int
    detail: dict[str, int]
    clipping: bool  # the store keeps a float32 gradient per parameter


@dataclass(frozen=True)
class Shortage:
    """One memory a run needs more of than the machine has (disk: swap space on the host's disk)."""
    memory: Literal["host", "device", "disk"]
    needed_bytes: int
    available_bytes: int
    advice: str  # what the numbers are made of and what to change

    def __str__(self) -> str:
        return (f"{self.memory} {'space' if self.memory == 'disk' else 'memory'}: needs {self.needed_bytes / GiB:.1f} GiB, "
                f"{self.available_bytes / GiB:.1f} GiB available ({self.advice})")


class DoesNotFit(ValueError):
    """A run (or a benchmarked system's point) needs more memory than the machine has; raised
    before anything is allocated. `shortages` says which memory ran short and by how much."""

    def __init__(self, what: str, shortages: list[Shortage]):
        assert shortages
        self.shortages = tuple(shortages)
        super().__init__(f"{what} does not fit: " + "; ".join(str(s) for s in shortages))

    @property
    def memory(self) -> Literal["host", "device", "disk"]:
        """The memory that ran short; where several did, the host's first (the harder bound), then the disk's."""
        short = {s.memory for s in self.shortages}
        return next(m for m in ("host", "disk", "device") if m in short)


def plan(shape: ModelShape, s: EngineSettings, data_bytes: int = 0) -> MemoryPlan:
    """Bytes needed to train `shape` with the resolved settings `s`, and `data_bytes` of
    tokenised examples held in host memory (data/pipeline.py)."""
    c = 2 if s.compute_dtype == "bfloat16" else 4
    M, tokens, pinned = s.microbatches, s.tokens, s.pinned
    h, v, L = shape.hidden, shape.vocab, shape.num_layers
    layer = max(Layout.of(specs).numel for specs in shape.layer_layouts)  # the largest layer (DeepSeek's MoE ones)
    head = Layout.of(shape.head_specs).numel + (v * h if shape.tied else 0)
    unit = max(layer, head)
    # per token, what a layer's MLP (or router and experts) keeps for its backward, with the
    # library's code or the compiled kernels (ModelShape.mlp_kept_compiled)
    mlp = shape.mlp_kept_compiled if MLP.runs(s) else shape.mlp_kept
    scores = s.tokens // s.seq_len * shape.attention_scores(s.seq_len)  # eager attention's, per micro-batch
    attn_kept = FAMILY_ATTN_KEPT.get(shape.family, ATTN_KEPT)
    T, N, chunk_mlp = s.device_tiles, s.no_recompute_layers, s.mlp_chunk_tokens
    recomputed = [b for b in schedule.blocks(L, s.checkpoint_every, N) if b.recomputed]
    blocks = len(recomputed)  # each with a checkpoint
    B = max((b.end - b.start for b in recomputed), default=0)  # the largest one's layers (the graphs held at once)
    store_host, store_device = HostStore.nbytes(shape, s)
    R = s.local_ranks  # the host store is shared by the host's ranks; the rest is per rank
    host = {
        "store": store_host,
        "optimizer_scratch": R * SCRATCH_BYTES if s.split_masters else 0,  # a split tile's chunk, joined
        # each rank's slabs hold its part of a layer: a host's ranks together what one rank's hold;
        # with clipping none: gradients return into the store's tiles (their buffers: in `store`)
        "grad_slabs": 0 if s.clipping else R * max(1, s.grad_slabs) * pinned_bytes(slab_numel(layer, R) * 4, pinned),
        "embedding_staging": R * pinned_bytes(tokens * h * c, pinned),
        "checkpoint_offload": R * (blocks * M * pinned_bytes(tokens * h * c, pinned)) if s.offload_checkpoints else 0,
        # registered at their exact size, each part page-aligned (activations.KeptAttention)
        "attention_offload": R * s.offloaded_attention_layers * M * sum(
            -(-n // PAGE) * PAGE for n in kept_attention.kept_parts(shape, tokens, c)),
        "runtime": R * HOST_OVERHEAD,
        "data": R * data_bytes,
    }
    chunk = min(s.loss_chunk_tokens, tokens)
    device = {
        "weight_buffers": s.weight_buffers * unit * c,
        # a load of whole masters in another dtype than the compute's stages them on the device (buffers.py)
        "load_staging": STAGE * s.master.itemsize if s.master != s.compute and not s.split_masters else 0,
        # float32 step gradients: a block's layers' plus one still returning (no more than the
        # model has), and the head's; untied, also the embedding's (kept through the backward for
        # its rows)
        "grad_accumulators": (min(max(B, 1) + 1, L) * layer + head + (0 if shape.tied else v * h)) * 4,
        "layer_grads": layer * c,  # autograd's per-parameter gradients of one layer
        "head_chunk": chunk * v * (4 + 4 + c),  # logits, their float32 copy and gradient
        # block inputs of every micro-batch (two blocks when offloaded), plus the hidden states
        # and their gradients in flight
        "checkpoints": ((min(2, blocks) if s.offload_checkpoints else blocks) + 2) * M * tokens * h * c,
        # what one layer's graph keeps, per token: attn_kept h (its input, the norms' outputs, q before
        # and after rotary, attention out and its copy, the residual sum) and the MLP's (chunked: only
        # for one chunk, in its backward); eager attention's softmax over every head's scores
        "block_activations": B * (tokens * attn_kept * h + min(tokens, chunk_mlp or tokens) * mlp + scores) * c,
        # the graphs of the layers not recomputed, every micro-batch's, from their forward to their
        # backward (a chunked MLP keeps only its input, counted within attn_kept h)
        "kept_graphs": N * M * (tokens * (attn_kept * h + (0 if chunk_mlp else mlp)) + scores) * c,
        # the attention outputs and log-sum-exps of the layers that keep them, every micro-batch's,
        # from their forward to their recompute's backward (kept_attention.py); of those kept in
        # host memory, two blocks' at most (activations.py)
        "kept_attention": (s.keep_attention_layers - s.offloaded_attention_layers
                           + min(s.offloaded_attention_layers, 2 * s.checkpoint_every))
        * M * kept_attention.kept_bytes(shape, tokens, c),
        # a layer's backward beyond its graph: gradients through the rotary embedding and attention,
        # flash attention's float32 dq accumulator (the norms' temporaries are chunked: lean_norm.py);
        # eager attention's scores, masked, with the sinks, their softmax and its gradient
        "backward_temporaries": (4 * tokens * h + 3 * scores) * c,
        "workspace": DEVICE_WORKSPACE,
        # data-parallel ranks: the summed part of the unit being reduced (distributed.Comm.reduce_part)
        "gradient_reduction": -(-unit // s.local_ranks) * 4 if s.ranks > 1 else 0,
        # master and moments of the device tiles, and the layers' float32 buffers (HostStore.buffers);
        # with clipping the device tiles' step gradients wait for the global norm
        "device_tiles": store_device + (max(0, T - 1) * layer * 4 if s.clipping else 0),
    }
    return MemoryPlan(sum(host.values()), sum(device.values()),
                      {**host, **{"device." + k: b for k, b in device.items()}}, s.clipping)


def admit(p: MemoryPlan, host_available: int, device_available: int | None,
          shared_available: int | None = None, device_is_host: bool = False) -> None:
    """Raise DoesNotFit, with the numbers and what to change, when the plan does not fit.
    `shared_available`: the shared-memory file system's free bytes, where the ranks' one host store
    goes (distributed.py); None: the store is not shared. `device_is_host`: a CPU run, whose
    "device" side (activations, checkpoints, buffers; no GPU workspace) is host memory too."""
    shortages = []
    if device_is_host:
        on_host = p.device_bytes - p.detail["device.workspace"]
        if p.host_bytes + on_host > host_available:
            acts = sum(p.detail[f"device.{k}"] for k in ("block_activations", "checkpoints", "kept_graphs", "kept_attention"))
            shortages.append(Shortage(
                "host", p.host_bytes + on_host, host_available,
                f"a CPU run computes in host memory: the plan's host side {p.host_bytes / GiB:.1f} GiB and its "
                f"compute side {on_host / GiB:.1f} GiB, of which activations {acts / GiB:.1f} GiB; lower "
                f"data.batch_size, data.grad_accum or data.seq_len, engine.checkpoint_every or "
                f"engine.loss_chunk_tokens, or state engine.host_memory_gb if the OS under-reports it"))
            raise DoesNotFit("the run", shortages)
    if shared_available is not None and p.detail["store"] > shared_available:
        shortages.append(Shortage(
            "host", p.detail["store"], shared_available,
            "the ranks' shared host store goes to /dev/shm, whose size limit is below it: remount it larger "
            "(mount -o remount,size=...) or make the store smaller"))
    if p.host_bytes > host_available:
        shortages.append(Shortage(
            "host", p.host_bytes, host_available,
            f"store {p.detail['store'] / GiB:.1f} GiB, gradient slabs {p.detail['grad_slabs'] / GiB:.1f} GiB; "
            + ("clipping keeps a float32 gradient per parameter, optim.max_grad_norm=null saves 4 bytes per "
               "parameter; " if p.clipping else "")
            + "fewer engine.grad_slabs (each holds one layer's float32 gradient, a rank's part of it), engine.master_dtype=bfloat16, "
            "a smaller model, or state engine.host_memory_gb if the OS under-reports it"))
    if device_available is not None and p.device_bytes > device_available:
        acts = sum(p.detail[f"device.{k}"] for k in ("block_activations", "checkpoints", "kept_graphs", "kept_attention"))
        shortages.append(Shortage(
            "device", p.device_bytes, device_available,
            f"activations {acts / GiB:.1f} GiB; lower data.batch_size, data.grad_accum or data.seq_len, "
            f"engine.checkpoint_every, engine.loss_chunk_tokens, engine.mlp_chunk_tokens, "
            f"engine.no_recompute_layers or engine.keep_attention_layers, or set engine.offload_checkpoints"))
    if shortages:
        raise DoesNotFit("the run", shortages)

