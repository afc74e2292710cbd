"""PyTorch native: the whole model resident on the GPU, float32 master weights with bf16 autocast,
activation checkpointing, fused AdamW on the device. The reference every system is checked against."""
from __future__ import annotations

import torch

from baselines import hf
from suite.system import System


class Native(System):
    # float32 weights, gradients and two moments on the device
    BYTES_PER_PARAM = 16

    def __init__(self, spec, device: torch.device):
        hf.require_device(spec, device, self.BYTES_PER_PARAM, "native training")
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
