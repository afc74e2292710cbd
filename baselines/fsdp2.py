"""FSDP2 CPU offload: `fully_shard` per decoder layer and at the root with `CPUOffloadPolicy`
(pinned float32 parameters, gradients and optimizer state on the host), bf16 mixed precision,
activation checkpointing, fused AdamW on the CPU.

spec.options (anything else is refused):
- `accumulate`: where the micro-batches' gradients are summed. "host" (FSDP2's own behaviour):
  every micro-batch's are reduced and copied to the host and added there; from the second
  micro-batch on, FSDP2 makes that copy blocking, into fresh pageable memory, since the host's add
  needs it (torch.distributed.fsdp's `foreach_reduce`). "device": the documented route for
  accumulation without communication (`set_requires_gradient_sync(False)` before all but the last
  micro-batch): float32 unsharded gradients summed on the GPU (4 B/param of the whole model more on
  each), reduced and copied once a step; on the H200 at the 7B width on 7 layers, 8 x 4 x 4096,
  6.1 s a step where the host's took 31.2 (docs/decisions.md, "FSDP2's accumulation").
  "auto" (the default): "device" where its count leaves AUTO_SLACK of the device free, else
  "host"; the result's info names the choice.
- `admission`: false tries a point the host or device admission would refuse.

On a GPU its CUDA allocator grows expandable segments, as native's and the engine's do (a user's
PYTORCH_CUDA_ALLOC_CONF wins). The cache keeps what it frees and, where no kept block fits, takes
free memory before it gives any back (NVML saw 10 to 28 GiB above the allocated peak with either
kind of segment), so that gap is no measure of a step's need; what fails with fixed segments is a
large block while the free memory lies in pieces (native's 7B at 4 x 4096 on an H200), and an
expandable segment maps a block wherever pages are free. At 14B on an H200, 8 x 4 x 4096, `auto`
then sums on the GPU (129.9 GiB allocated of 139.3) at 43.0 s a step, where the host's sum took
162.2 (docs/decisions.md, "FSDP2's accumulation").

On one GPU, a one-process group; on spec.gpus = N (under torchrun, baselines/hf.py) the parameters,
gradients and optimizer state are sharded over the N ranks (a 1-D mesh), each rank computes on its
rows of every micro-batch, and the gradients are averaged over the ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from baselines import hf
from baselines import native
from megatrain.device import grow_expandable_segments
from megatrain.shapes import ModelShape
from megatrain.units import GiB
from suite.system import System, check_options


ACCUMULATE = ("auto", "host", "device")
# `auto` accumulates on the device where its count (device_need) leaves this much free: for the
# count's error (0.1 to 0.9 GiB under the allocated peaks measured) and the CUDA context's and
# libraries' memory outside the allocator (the module's note says why the cache needs none)
AUTO_SLACK = 6 * GiB
# at the loss: native's 10 B a logit (its bf16 value, float32 copy and float32 log-softmax) and 2
# more, measured: every FSDP2 point's peak was 2 B a logit above the count at 10; plausibly the
# logits' bf16 gradient, which the bf16 model (no autocast) holds beside them
LOSS_BYTES_PER_LOGIT = native.LOSS_BYTES_PER_LOGIT + 2


def _accumulate(options: dict) -> str:
    check_options("fsdp2", options, FSDP2.OPTIONS)
    where = options.get("accumulate", "auto")
    if where not in ACCUMULATE:
        raise ValueError(f"fsdp2 options.accumulate: {where!r}; known: {list(ACCUMULATE)}")
    return where


def accumulation(spec, device: torch.device, ranks: hf.Ranks) -> str:
    """Where the point sums its micro-batches' gradients: its `accumulate` option, `auto` resolved on
    the first rank's free memory (every rank's choice is that one's)."""
    where = _accumulate(spec.options)
    if where != "auto":
        return where
    if device.type != "cuda":
        return "device"
    return auto_accumulation(spec, hf.agreed(ranks, torch.cuda.mem_get_info(device)[0]))


def auto_accumulation(spec, free: int) -> str:
    """`auto`'s choice with `free` bytes of the device free: "device" where its count leaves
    AUTO_SLACK, else "host"."""
    return "device" if device_need(spec, "device")[0] + AUTO_SLACK <= free else "host"


def device_need(spec, accumulate: str) -> tuple[int, str]:
    """A rank's device bytes at its loss, counted, and what they are made of: the loss's logits, every
    layer's bf16 checkpoint, the root's parameters (embedding, head) unsharded in bf16, and with
    `accumulate: device` after a step's first micro-batch the float32 unsharded gradients of the
    whole model, and one layer's weights gathered in bf16 (the peaks grew with the layer's size:
    0.9 GiB above the count without it at the 7B width, 1.8 at twice that width). Lower bounds: on
    the measured points (H100 and H200, 1.6 to 8.7 B parameters, layers of 0.07 to 0.93 B, 1 to 4
    ranks, both accumulations) 0.1 to 0.9 GiB under the allocator's peak."""
    shape = ModelShape(spec.hf_config())
    p = shape.total_params()
    tokens = spec.batch_size // spec.gpus * spec.seq_len
    layer = sum(s.numel for s in shape.layer_specs)
    root = p - sum(s.numel for _, specs in shape.units()[1:-1] for s in specs)  # embedding and head
    parts = {"the loss's logits": tokens * shape.vocab * LOSS_BYTES_PER_LOGIT,
             "checkpoints": shape.num_layers * tokens * shape.hidden * 2,
             "the root's bf16 weights": 2 * root, "a layer's gathered bf16 weights": 2 * layer}
    if accumulate == "device" and spec.grad_accum > 1:
        parts["float32 unsharded gradients"] = 4 * p
    return sum(parts.values()), "at the loss: " + ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in parts.items())


class FSDP2(System):
    # host RSS measured on the H100 machine: 20.3 B/param at the 3B shape, 24.3-24.9 at the 7B
    # width on 7 and 14 layers (results/h100/points/depth); admission takes the larger
    HOST_BYTES_PER_PARAM = 25
    # each rank beyond the first: every rank builds the whole float32 model on the host before
    # fully_shard keeps its shard, and the process tree of 2 ranks measured on the CPU (gloo, a 103M
    # model) held 4.1 B/param more than 1 rank's, beside the runtime (hf.RANK_HOST_BYTES)
    RANK_BYTES_PER_PARAM = 4
    OPTIONS = frozenset({"accumulate", "admission"})
    host_blind_options = frozenset({"accumulate"})  # host peaks alike: 166.5 and 168.6 GiB at L28 on the H200

    @classmethod
    def summing(cls, spec, device_free: int | None) -> str | None:
        where = spec.options.get("accumulate", "auto")
        if where != "auto":
            return where
        return None if device_free is None else auto_accumulation(spec, device_free)

    def __init__(self, spec, device: torch.device):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        lap = hf.Laps()
        if device.type == "cuda":
            grow_expandable_segments()
        self.device = device
        _accumulate(spec.options)  # refused before the process group
        self.ranks = hf.join(device)
        self.accumulate = accumulation(spec, device, self.ranks)
        hf.require_host(spec, self.HOST_BYTES_PER_PARAM, "FSDP2 CPU offload", self.RANK_BYTES_PER_PARAM, self.ranks)
        hf.require_device(spec, device, lambda: device_need(spec, self.accumulate), "FSDP2 CPU offload", self.ranks)
        lap("join_and_admission")
        self.model = hf.build_model(spec, "cpu")  # the same seeded weights on every rank
        hf.enable_checkpointing(self.model)
        self.model.train()
        lap("build")
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        kwargs = dict(mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
                      offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
        mesh = dist.device_mesh.init_device_mesh(device.type, (self.ranks.world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(self.model, mesh=mesh, **kwargs)
        lap("shard")  # each rank's shard copied into (pinned) host memory
        self.opt = torch.optim.AdamW(hf.adamw_params(self.model, spec.weight_decay), **hf.adamw_kwargs(spec),
                                     fused=True)  # its state is made at the first step, not here
        lap("optimizer")
        self.setup_s = lap.seconds

    def step(self, microbatches) -> dict:
        before = self.model.set_requires_gradient_sync if self.accumulate == "device" else None
        return hf.train_step(self.model, self.opt, microbatches, self.device, autocast=False, ranks=self.ranks,
                             before=before)

    def save(self, path: str) -> None:
        """Gathered by every rank (a collective), written by the first."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.ranks.rank == 0:
            self.model.save_pretrained(path, state_dict=full)
        dist.barrier()

    def info(self) -> dict:
        return {"master_dtype": "float32", "compute_dtype": "bfloat16" if self.device.type == "cuda" else "float32",
                "optimizer": "torch.optim.AdamW(fused=True) on the CPU", "offload": "CPUOffloadPolicy",
                "accumulate": self.accumulate,
                "activation_checkpointing": True, "setup_s": self.setup_s}

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
