"""PyTorch native: the whole model resident on the GPU, float32 master weights with bf16 autocast,
activation checkpointing, fused AdamW on the device. The reference every system is checked against.
Its CUDA allocator grows expandable segments, as the engine's does (a user's PYTORCH_CUDA_ALLOC_CONF
wins): with fixed segments, 7B at 4 x 4096 on an H200 failed its second step's logits with 22 GiB
of the cache free but fragmented."""
from __future__ import annotations

import torch

from baselines import hf
from megatrain.device import grow_expandable_segments
from megatrain.shapes import ModelShape
from megatrain.units import GiB
from suite.system import System, check_options

# float32 weights, gradients and two moments on the device
BYTES_PER_PARAM = 16
# at the loss, a logit's bf16 value, its float32 copy and its float32 log-softmax (transformers'
# cross-entropy): 5.9 GiB a 4096-token sequence of a 151,936-entry vocabulary, measured at 3B
LOSS_BYTES_PER_LOGIT = 10


def device_need(spec) -> tuple[int, str]:
    """Native's device bytes at its fullest, counted, and what they are made of: the larger of the
    step's end (weights, gradients and moments) and the loss of a micro-batch once the moments
    exist. There autocast's bf16 copies of the weights (all but the input embedding's) are still
    held, the checkpoints of every layer (the float32 residual stream), the loss's logits, and,
    after a step's first micro-batch, the gradients. Its parts are lower bounds: on the measured
    points the count is 1.1 to 3.1 GiB under the allocator's peak (3B at 4 x 4096: 67.3 against
    68.4 GiB); at 7B the parts before the logits come to 110.5 GiB at 8 x 4096 where the run held
    111.8 when its logits did not fit, and to 104.4 GiB at 4 x 4096 where the run held 111.7 (an
    H200, its second step)."""
    shape = ModelShape(spec.hf_config())
    p = shape.total_params()
    tokens = spec.batch_size * spec.seq_len
    parts = {"weights and moments": 12 * p, "autocast's bf16 weights": 2 * (p - shape.vocab * shape.hidden),
             "checkpoints": shape.num_layers * tokens * shape.hidden * 4,
             "the loss's logits": tokens * shape.vocab * LOSS_BYTES_PER_LOGIT}
    if spec.grad_accum > 1:
        parts["gradients"] = 4 * p
    at_loss = sum(parts.values())
    at_end = BYTES_PER_PARAM * p
    if at_end >= at_loss:
        return at_end, f"{BYTES_PER_PARAM} B/param x {p / 1e9:.2f} B params: weights, gradients and moments"
    return at_loss, "at the loss: " + ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in parts.items())


class Native(System):
    OPTIONS = frozenset({"admission"})  # hf.require_device's
    @classmethod
    def device_need(cls, spec) -> tuple[int, str]:
        return device_need(spec)

    def __init__(self, spec, device: torch.device):
        check_options("native", spec.options, self.OPTIONS)
        hf.require_device(spec, device, lambda: device_need(spec), "native training")
        if device.type == "cuda":
            grow_expandable_segments()
        self.device = device
        self.autocast = device.type == "cuda"
        self.model = hf.build_model(spec, device)
        hf.enable_checkpointing(self.model)
        self.model.train()
        self.opt = torch.optim.AdamW(hf.adamw_params(self.model, spec.weight_decay), **hf.adamw_kwargs(spec),
                                     fused=True)

    def step(self, microbatches) -> dict:
        return hf.train_step(self.model, self.opt, microbatches, self.device, self.autocast)

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)

    def info(self) -> dict:
        return {"master_dtype": "float32", "compute_dtype": "bfloat16" if self.autocast else "float32",
                "optimizer": "torch.optim.AdamW(fused=True)", "activation_checkpointing": True}
