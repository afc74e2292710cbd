"""The engine's torch.compile'd kernels, built in this process rather than by a pool of workers.

Inductor builds a GPU graph's Triton kernels in a pool of worker processes (its compile_threads:
one per core, at most 32), started at the first compile and kept for the life of the process, each
a Python with torch imported. The engine builds a handful of small kernels once (the norms, the
gated MLP's product, the host AdamW), so the pool saves seconds once and holds host memory for
the whole run: 6.6 GiB on the H100 host's 16 cores (docs/decisions.md, "Kernels built in-process"), where
every GiB of host is model state. Each call of a kernel from here sets compile_threads to 1 first:
from the first one on, inductor builds in this process, and no pool starts. The setting is the
process's (inductor has no per-graph one that reaches the pool: the backend warms the pool before
a graph's options apply), and always the same value, so threads calling kernels side by side (the
optimizer worker's AdamW beside the layers') never see it change under them.

Each is built in inductor's deterministic mode: a reduction's launch configuration (the norms'
row statistics, their weight's gradient) is the one its heuristic names, not the fastest of several
timed at the first launch. Those configurations sum in different orders, so a choice by the clock
could differ between a run and its resumption; the heuristic's does not. Measured on the H100, the
7B step with both against the timed, pooled build: 466.2 against 464.0 model TFLOP/s
(docs/decisions.md, "Kernels built in-process").

Dynamo builds a function anew for each form of its inputs its guards tell apart (rank, dtype,
whether a tensor requires gradients, a float's value), at most recompile_limit (8) times a process,
and past that runs the function's library ops, silently: a process that trains several models (the
GPU tests' did) then computes some calls by the kernel and others by the library ops, which agree
to rounding only (on the H200 a test's two runs that match bit for bit stopped matching). So each
kernel sees one form: its inputs detached here (every caller differentiates by hand) and, the
norms' and the MLP's, as rows; a process then builds one per dtype and constant (eps, GPT-OSS's
float32 scale) and, the norms', per row width (lean_norm says why). A model's norms have one or two
widths, but a process that trains several models sees more forms than a model does, so the first
kernel's build raises the process's limit to RECOMPILE_LIMIT (a limit, not a cost: a build is made
only for a form that comes).

Two threads call these kernels: the main thread (the layers') and the optimizer worker (the AdamW).
While one thread builds a kernel, torch's flag that FX is tracing is set for the whole process, and
a compiled function called from the other thread meanwhile refuses to run ("Detected that you are
using FX to symbolically trace a dynamo-optimized function", pytorch/pytorch#126024): on the H100 a
first step on an empty inductor cache failed so, the AdamW called while the layers' kernels built.
The refusal comes before anything runs, so a call here waits while the flag is set and tries again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
import torch.fx._symbolic_trace as fx_trace


RECOMPILE_LIMIT = 64  # builds of one kernel a process: its forms (dtype, constants, width) in every model it trains

# the check dynamo makes before a compiled call (older torch: the flag alone, with a logged warning)
_tracing = getattr(fx_trace, "is_fx_symbolic_tracing", fx_trace.is_fx_tracing)


def compiled(fn: Callable, **options) -> Callable:
    """`fn` built by torch.compile (dynamic shapes, inductor's deterministic mode and `options`)
    in this process. torch.compile is asked at the first call, not here: dynamo and inductor
    take about a second to import (the 2-core CPU machine), which a process that never calls a
    kernel (the workflow's planning, a harness's parent, a baseline's worker) then does not pay."""
    made = None  # the compiled function and inductor's config, once the first call made them
    lock = threading.Lock()

    @functools.wraps(fn)
    def run(*args):
        nonlocal made
        if made is None:
            with lock:  # the main thread and the optimizer worker may both call first
                if made is None:
                    import torch._dynamo.config as dynamo
                    import torch._inductor.config as inductor
                    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
                    made = torch.compile(fn, dynamic=True, options={"deterministic": True, **options}), inductor
        kernel, inductor = made
        # every caller differentiates by hand (an autograd.Function's forward and backward, the
        # optimizer's update): detached, whether an input requires gradients is not one more form
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
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


def check_vector_isas() -> None:
    """Inductor's check of which vector instruction sets this CPU's compiled code may use, made
    before a first CPU build would make it. On torch 2.11 each check builds a test program and
    loads it in a fresh Python that imports torch: a set's own check, and for some sets more
    (AVX-512's bf16, VNNI, AMX: each adds its compiler flags when it passes), one after another:
    27.5-28.8 s of each point's set-up on the four-GPU host's 64 cores
    (docs/decisions.md, "The host AdamW"). Here every candidate's checks run at once, a thread each
    (the checks are subprocesses and builds under per-check file locks); inductor keeps each set's
    answer, and its flags, for the process, so its list, and every build after, reuses them. On the
    2-core CPU machine with torch 2.11 (four sets, their builds in the cache): 7.9-8.0 s against
    13.0-13.4 one after another; on the four-GPU host 14-22 s.

    Inductor keeps the answers for one process only, so each run on a machine paid them again.
    Once every check has passed, their answers are written beside inductor's cache, keyed by what
    they rest on (torch, the Python that loads the test, the C++ compiler, the candidates the CPU's
    flags admit); a later process with the same key replays them (each candidate's `check_build`
    answered from the record while its answer is taken) and builds nothing. Every check is
    replayed, not only a set's own: a set whose further checks were left to inductor made them at
    the first kernel's load instead, one after another (seen on the two-H200 host: 15-44 s of the
    host AdamW's build after a kept answer). A failed check is never written: such a machine
    checks every time. Where a torch has no such check, nothing runs."""
    try:
        import torch._inductor.config as inductor
        from torch._inductor import cpu_vec_isa
        if platform.machine() not in ("x86_64", "AMD64") or inductor.cpp.vec_isa_ok is not None:
            cpu_vec_isa.valid_vec_isa_list()
            return
        flags = cpu_vec_isa.x86_isa_checker()  # inductor's own filter: the CPU's flags
        candidates = [i for i in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
        record, key = _isa_record(candidates)
        kept = _kept(record)
        replayed, made = kept.get(key, {}), {}
        for isa in candidates:  # each candidate's checks: the kept answer, else inductor's own
            vars(isa)["check_build"] = functools.partial(_check_build, isa, replayed, made)
        try:
            with ThreadPoolExecutor(max(1, len(candidates))) as pool:
                passed = list(pool.map(bool, candidates))
            cpu_vec_isa.valid_vec_isa_list()
        finally:
            for isa in candidates:
                vars(isa).pop("check_build", None)
        if record is not None and made and all(passed) and all(made.values()):
            temporary = record.with_name(f"{record.name}.{os.getpid()}")
            temporary.write_text(json.dumps({"checks": {**kept, key: {**replayed, **made}}}))
            os.replace(temporary, record)  # whole or absent, with ranks writing side by side
    except Exception:  # another torch, or the check failing: the build makes the check itself
        pass


def _check_build(isa, replayed: dict[str, bool], made: dict[str, bool], code: str) -> bool:
    """One of `isa`'s checks (a test program, its flags): its kept answer, else inductor's check,
    whose answer goes into `made`."""
    name = f"{isa.build_arch_flags()} {hashlib.sha256(code.encode()).hexdigest()[:16]}"
    if name in replayed:
        return replayed[name]
    made[name] = ok = type(isa).check_build(isa, code)
    return ok


def _isa_record(candidates: list) -> tuple[Path | None, str | None]:
    """Where the passed checks are kept, and this process's key among them (none where this torch
    names its cache or its compiler otherwise: then the check is made every time)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        compiler = Path(shutil.which(get_cpp_compiler()) or get_cpp_compiler()).resolve()
        stat = compiler.stat()
    except (ImportError, OSError):
        return None, None
    key = " | ".join([torch.__version__, sys.executable, f"{compiler} {stat.st_size} {stat.st_mtime_ns}",
                      " ".join(str(i) for i in candidates)])
    return Path(cache_dir()) / "megatrain_vector_isas.json", key


def _kept(record: Path | None) -> dict[str, dict[str, bool]]:
    """Each key's checks and their answers (none where the file is absent, unreadable or of
    another form)."""
    try:
        checks = json.loads(record.read_text())["checks"] if record is not None else {}
        return checks if isinstance(checks, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
