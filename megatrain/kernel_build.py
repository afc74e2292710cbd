"""The engine's torch.compile'd kernels, built in this process rather than by a pool of workers.

Inductor builds a GPU graph's Triton kernels in a pool of worker processes (its compile_threads:
one per core, at most 32), started at the first compile and kept for the life of the process, each
a Python with torch imported. The engine builds a handful of small kernels once (the norms, the
gated MLP's product, the loss), so the pool saves seconds once and holds host memory for
the whole run: 6.6 GiB on the H100 host's 16 cores (docs/decisions.md, "Kernels built in-process"), where
every GiB of host is model state. Each call of a kernel from here sets compile_threads to 1 first:
from the first one on, inductor builds in this process, and no pool starts. The setting is the
process's (inductor has no per-graph one that reaches the pool: the backend warms the pool before
a graph's options apply), and always the same value, so threads calling kernels side by side never
see it change under them. The library compiles too where a model's attention is flex attention
(GPT-OSS and Gemma on a GPU: its block masks, before any layer, and the attention): `in_process`,
called by the templates of such a model, sets the same before those builds.

Each is built in inductor's deterministic mode: a reduction's launch configuration (the norms'
row statistics, their weight's gradient) is the one its heuristic names, not the fastest of several
timed at the first launch. Those configurations sum in different orders, so a choice by the clock
could differ between a run and its resumption; the heuristic's does not. Measured on the H100, the
7B step with both against the timed, pooled build: 466.2 against 464.0 model TFLOP/s
(docs/decisions.md, "Kernels built in-process").

Each kernel is built for any number of rows and for the widths it is called with (the last
dimension of each input): the rows vary between calls (padded batches, the loss's last chunk), the
widths only between models, and a fixed width spares each kernel index arithmetic and loops over a
width only known at run time. On the H200 the layer probe, every size free against fixed widths:
Qwen3-30B-A3B's layer 329.7 -> 419.4 model TFLOP/s (its other kernels 17.2 -> 9.4 ms), GPT-OSS-20B's
303.7 -> 319.6, the 7B's 515.3 -> 520.0 (docs/decisions.md, "Kernels built for fixed widths").

Dynamo builds a function anew for each form of its inputs its guards tell apart (rank, dtype,
whether a tensor requires gradients, a float's value, a fixed width), at most recompile_limit (8)
times a process, and past that runs the function's library ops, silently: a process that trains
several models (the GPU tests' did) then computes some calls by the kernel and others by the
library ops, which agree to rounding only (on the H200 a test's two runs that match bit for bit
stopped matching). So each kernel sees few forms: its inputs detached here (every caller
differentiates by hand) and, the norms' and the MLP's, as rows; a process then builds one per
dtype, constant (eps, GPT-OSS's float32 scale) and width. A model has a few widths, but a process
that trains several models sees more forms than a model does, so the first kernel's build raises
the process's limit to RECOMPILE_LIMIT (a limit, not a cost: a build is made only for a form that
comes).

While one thread builds a kernel, torch's flag that FX is tracing is set for the whole process, and
a compiled function called from another thread meanwhile refuses to run ("Detected that you are
using FX to symbolically trace a dynamo-optimized function", pytorch/pytorch#126024): on the H100 a
first step on an empty inductor cache failed so, when the host AdamW was such a kernel, called by
the optimizer worker while the layers' kernels built. The refusal comes before anything runs, so a
call here waits while the flag is set and tries again.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import torch
import torch.fx._symbolic_trace as fx_trace


RECOMPILE_LIMIT = 64  # builds of one kernel a process: its forms (dtype, constants, width) in every model it trains

# the check dynamo makes before a compiled call (older torch: the flag alone, with a logged warning)
_tracing = getattr(fx_trace, "is_fx_symbolic_tracing", fx_trace.is_fx_tracing)


def compiled(fn: Callable, **options) -> Callable:
    """`fn` built by torch.compile (free rows, fixed widths: _rows_free; inductor's deterministic
    mode and `options`) in this process. torch.compile is asked at the first call, not here: dynamo
    and inductor take about a second to import (the 2-core CPU machine), which a process that never
    calls a kernel (the workflow's planning, a harness's parent, a baseline's worker) then does not
    pay."""
    made = None  # the compiled function and inductor's config, once the first call made them
    lock = threading.Lock()

    @functools.wraps(fn)
    def run(*args):
        nonlocal made
        if made is None:
            with lock:  # two threads may both call first
                if made is None:
                    import torch._dynamo.config as dynamo
                    import torch._inductor.config as inductor
                    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
                    made = torch.compile(fn, dynamic=False, options={"deterministic": True, **options}), inductor
        kernel, inductor = made
        # every caller differentiates by hand (an autograd.Function's forward and backward, the
        # optimizer's update): detached, whether an input requires gradients is not one more form
        args = tuple(_rows_free(a.detach()) if isinstance(a, torch.Tensor) else a for a in args)
        inductor.compile_threads = 1
        while True:
            while _tracing():  # another thread is building a kernel
                time.sleep(0.001)
            try:
                return kernel(*args)
            except RuntimeError:
                if not _tracing():  # not the refusal: a failure of this kernel
                    raise
    return run


def _rows_free(t: torch.Tensor) -> torch.Tensor:
    """`t` with every dimension but the last free in the kernel's build (a vector's one too): the
    rows (tokens, batch, sequence, heads, the loss's chunk) vary between calls, the last dimension
    (hidden, head, vocabulary width, the router's picks) only between models. Weakly: a length the
    kernel ties to a fixed width (a norm's weight) is fixed with it."""
    for dim in range(t.dim() - 1 if t.dim() > 1 else t.dim()):
        torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def in_process() -> None:
    """Inductor's builds in this process from now on, whoever asks for them (the module's docstring)."""
    import torch._inductor.config as inductor
    inductor.compile_threads = 1
