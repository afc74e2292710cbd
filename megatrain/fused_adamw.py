"""The host AdamW of a whole float32 master and its bf16 shadow in one pass over memory.

The eager update (optim.adamw) is torch's fused AdamW, which reads the gradient, the master and
both moments and writes the master and the moments (28 bytes a parameter), then a second pass
that reads the master again to write its bf16 shadow (6 more). The update is bound by memory
bandwidth, so here `torch.compile` (inductor's C++ code for the CPU, vectorised and threaded with
OpenMP) turns the same arithmetic and the shadow's cast into one loop: 30 bytes a parameter. On the
2-core CPU machine (experiments/probes/adamw_rate.py, 32 M elements, two threads, two interleaved
runs) 1.13-1.16 G elements/s against 0.86-0.87 eager, 1.3x (0.61 on one thread); on the two-H200
host (32 threads) 7.73 against 6.41, 1.2x, and a 14B step's CPU update 2.53 s against 3.41
(docs/decisions.md, "The host AdamW").

The arithmetic is torch's fused AdamW's (decoupled decay, `lerp` for the first moment, bias
corrections folded into the step size and the denominator), in another order of roundings: the
weights agree with the eager update to a few float32 ulps, not bit for bit, and the shadow is the
same round-to-nearest-even cast of the master. Split masters (store.split/join) keep the eager
path: inductor leaves code with int16 values unvectorised (its scalar loop was no faster), and a
version over int32 pairs of the 16-bit halves, vectorised and exact, ran slower than the eager
join, update and split on the 2-core machine.

Building the kernel needs a C++ compiler, as torch.compile on the CPU always does: `probe` compiles
it once, before the run starts, so a machine without one is told at once (or, under `auto`, runs the
eager update); before it the trainer makes inductor's check of the CPU's vector instruction sets,
every set's at once, and once a machine (kernel_build.check_vector_isas: on torch 2.11 about 28 s
of a point's set-up on the four-GPU host when made one set after another). `optim.rates` then
times both updates on arrays larger than the caches, in the thread count the optimizer worker uses,
and `auto` keeps the compiled one only where it is faster.
Inductor chooses a kernel's OpenMP parallelism at build time, from the sizes it first sees: built
by the probe's few elements it came out as one serial loop (seen on the CPU machine), and a 14B run
with that build on the two-H200 host stepped at half the rate (docs/decisions.md, "The host AdamW").
`cpp.dynamic_threads` always emits the parallel region and lets the calling thread's team size
decide.

The update runs on the optimizer worker while the main thread launches the GPU's kernels, so it
must not hold the GIL. Inductor's default Python binding of a CPU kernel calls it with the GIL held:
each 7B layer's update (about 50 ms) then stalled the launches, and at 4 x 4096 tokens a step the
GPU sat idle for them (docs/decisions.md, "The host AdamW"). `cpp_wrapper` builds the graph's entry in
C++, which releases the GIL for the call; the kernel and its results are the same (bit for bit,
and no slower to build, on the CPU machine).
"""
from __future__ import annotations

import math

import torch

from megatrain.config import OptimConfig
from megatrain.kernel_build import compiled


def _update(param, grad, exp_avg, exp_avg_sq, shadow, decay, step_size, bc2_sqrt,
            beta1: float, beta2: float, eps: float) -> None:
    """In place, as torch's fused AdamW: decay, moments, step; then the shadow from the new master."""
    param.mul_(decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + eps))
    shadow.copy_(param)


_compiled = compiled(_update, **{"cpp.dynamic_threads": True, "cpp_wrapper": True})


def update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           shadow: torch.Tensor, step: int, lr: float, weight_decay: float, cfg: OptimConfig) -> None:
    """AdamW update number `step` (1-based) of float32 `param` and its moments from `grad`, and
    `shadow` (bf16) recast from the result; all 1-D, of one length, on the CPU."""
    beta1, beta2 = cfg.betas
    scalar = lambda x: torch.tensor(x, dtype=torch.float32)  # tensors: no recompile as lr and step change
    _compiled(param, grad, exp_avg, exp_avg_sq, shadow, scalar(1 - lr * weight_decay),
              scalar(lr / (1 - beta1 ** step)), scalar(math.sqrt(1 - beta2 ** step)), beta1, beta2, cfg.eps)


def probe(cfg: OptimConfig) -> str | None:
    """Compile and run the kernel on a few elements: None if it works, else why not."""
    try:
        n = 256
        update(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16),
               1, 1e-3, 0.0, cfg)
    except Exception as e:  # the compiler's own error types (a missing C++ compiler, a failed build)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None

