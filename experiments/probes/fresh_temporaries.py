"""Probe: the cost of a CPU Adam update built from out-of-place torch ops, as ColossalAI's HybridAdam
runs it when the gradients are bf16 (Gemini with bf16 precision: HybridAdam sends bf16 gradients
to torch ops, and only float32 and float16 ones to its C++ kernel). Each tensor's update allocates
temporaries the size of the tensor (the float32 gradient, the square root, the denominator); glibc
serves allocations of more than 32 MB with mmap and unmaps them on free, so every temporary's pages
are faulted in and zeroed by the kernel again at every step. With mmap off (MALLOC_MMAP_MAX_=0, and
a trim threshold that keeps the freed heap) the same update reuses its pages after the first step.

    python -m experiments.probes.fresh_temporaries [PARAMS_M] [OUT.json]   (default 512 M parameters)

Run it twice, plain and with `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736` (glibc reads
them at the process's start); each prints and writes, a step, the seconds and the minor page faults."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch

TENSOR = 64 * 2**20  # elements a tensor: 256 MB in float32, past glibc's largest mmap threshold (32 MB)


def update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
           lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
    """Adam, out of place where the bf16 route is: a float32 gradient, a square root, a denominator."""
    g32 = g.float()
    m.mul_(betas[0]).add_(g32, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(g32, g32, value=1 - betas[1])
    denom = (v.sqrt() / math.sqrt(1 - betas[1] ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - betas[0] ** step))


def main() -> None:
    params = int(float(sys.argv[1]) * 2**20) if len(sys.argv) > 1 else 512 * 2**20
    tensors = max(1, params // TENSOR)
    torch.manual_seed(0)
    state = [(torch.randn(TENSOR), torch.randn(TENSOR, dtype=torch.bfloat16), torch.zeros(TENSOR), torch.zeros(TENSOR))
             for _ in range(tensors)]
    steps = []
    for step in range(1, 4):
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        for p, g, m, v in state:
            update(p, g, m, v, step)
        steps.append({"step": step, "seconds": time.perf_counter() - start,
                      "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
        print(f"step {step}: {steps[-1]['seconds']:.2f} s, {steps[-1]['minor_faults']} minor page faults", flush=True)
    result = {"params": tensors * TENSOR, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
              "torch": torch.__version__, "steps": steps}
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
