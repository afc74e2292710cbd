"""What torch 2.11 and Python 3.12 break in Ratel's artifact, adapted as its modules load, never in its files.

`install()` (run by sitecustomize.py in every Ratel process) does three things:

- Python 3.12 has no `distutils`; the op builders (op_ds/ops/op_builder/builder.py, async_io.py) import
  it at module level. setuptools carries a copy and, once imported, serves it as `distutils`.
- A post-import hook adapts four of the checkout's modules right after they execute:
    op_ds.ops.op_builder.builder  OpBuilder.jit_load drops the builders' own `-std=` flags, so the C++
        standard is the one torch's cpp_extension sets for its headers. AsyncIOBuilder passes
        `-std=c++14` after torch's flag and g++ keeps the last one: torch >= 2.1's headers then stop
        with "#error C++17 or later compatible compiler is required to use PyTorch".
    gpt_model  `checkpoint` without `use_reentrant` warns since torch 2.4 and torch says it will raise;
        the calls get `use_reentrant=True`, torch 2.0's default, so the artifact runs as it did there.
    ratel_init  SB_Init wraps the `__init__` of every nn.Module subclass on entry and, on exit, sets
        each class's `__init__` back to what it read on entry. A class without its own `__init__`
        read its parent's, already wrapped (parents come first), so the wrapper stays on it after
        the exit; its closure writes to SB_Init's file, closed by then. torch 2.0's classes defined
        their own; newer ones do not all (nn.MSELoss among them), and main.py's `nn.MSELoss()` after
        the model's construction stops with "I/O operation on closed file". After the exit, every
        class has again exactly the `__init__` it had before the entry (none where it had none).
    op_ds.ops.CPUAdam  Not a version difference but the artifact's own, on its host-memory route
        (`--is_nvme 0`, which upstream's run.sh never uses): SB_optimizer's set-up runs one update on
        zero gradients, then empties each subgroup's Adam moments (`.data = torch.Tensor()`, for the
        NVMe swapper to fill before each step); without NVMe nothing fills them, and the C++ Adam
        reads the parameter's count of elements from a null pointer: SIGSEGV at the first step.
        Before each step, a moment found empty beside a non-empty parameter is set to zeros of the
        parameter's size, which is exactly what it held (an update on zero gradients without weight
        decay, main.py's settings, leaves both moments zero). Runs that fill them are unchanged.

- A multiprocessing queue item that cannot be sent (shared memory full, a CUDA IPC handle refused, an
  object that does not pickle) is printed by Python's feeder thread and dropped; with the disk route's
  optimizer process waiting on that queue, main.py would then run on and hang at its final
  `p1.join()`. Such an error now ends the run at once (exit 70, the children killed first), so the
  harness reports it instead of waiting for its timeout. Nothing that runs is changed.

Each adaptation prints one `[ratel_compat]` line to stderr when it applies, so a run's log says
what was changed.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import traceback


def _say(message: str) -> None:
    print(f"[ratel_compat] {message}", file=sys.stderr, flush=True)


def ensure_distutils() -> None:
    """`import distutils` works on Python >= 3.12 when setuptools is installed (its copy is registered)."""
    if importlib.util.find_spec("distutils") is not None:
        return
    try:
        import setuptools  # noqa: F401  (registers setuptools._distutils as `distutils`)
    except ImportError:
        _say("no distutils and no setuptools: Ratel's op builders will not import (pip install setuptools)")
        return
    if importlib.util.find_spec("distutils") is not None:
        _say("distutils: setuptools' copy (Python >= 3.12 has none)")


def strip_std(flags: list[str]) -> list[str]:
    return [f for f in flags if not f.startswith("-std=")]


def _wrap(owner, name: str, make) -> bool:
    """`owner.<name>` replaced by `make(original)`, once (a module loaded again keeps one wrapper);
    whether it was replaced now."""
    original = getattr(owner, name)
    if getattr(original, "_ratel_compat", False):
        return False
    wrapper = functools.wraps(original)(make(original))
    wrapper._ratel_compat = True
    setattr(owner, name, wrapper)
    return True


def patch_builder(module) -> None:
    """OpBuilder.jit_load with the builder's cxx_args minus its -std= flags (torch's own flag applies)."""
    def torch_std(jit_load):
        def run(self, verbose=True):
            cxx_args = type(self).cxx_args
            self.cxx_args = lambda: strip_std(cxx_args(self))  # the instance's, read by jit_load
            return jit_load(self, verbose)
        return run

    if _wrap(module.OpBuilder, "jit_load", torch_std):
        _say("op builders: their -std= flags dropped, torch's C++ standard applies")


def patch_gpt_model(module) -> None:
    """gpt_model.checkpoint with torch 2.0's default use_reentrant=True made explicit."""
    def reentrant(checkpoint):
        def run(function, *args, use_reentrant=True, **kwargs):
            return checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
        return run

    if _wrap(module, "checkpoint", reentrant):
        _say("gpt_model: checkpoint(..., use_reentrant=True), torch 2.0's default")


def patch_ratel_init(module) -> None:
    """SB_Init's exit leaves every nn.Module subclass with the `__init__` it had before the entry."""
    import torch

    before: dict[type, object] = {}

    def recording(enter):
        def run(self):
            before.clear()
            before.update((cls, cls.__dict__.get("__init__")) for cls in module.get_all_subclasses(torch.nn.Module))
            return enter(self)
        return run

    def exactly(shutdown):
        def run():
            shutdown()
            for cls, init in before.items():
                if init is not None:
                    cls.__init__ = init
                elif "__init__" in cls.__dict__:
                    del cls.__init__
        return run

    if _wrap(module, "shutdown_init_context", exactly):
        _wrap(module.SB_Init, "__enter__", recording)
        _say("ratel_init: SB_Init's exit restores each module class's own __init__ (or its inherited one)")


def patch_cpu_adam(module) -> None:
    """DeepSpeedCPUAdam.step with any emptied moment set back to its zeros first."""
    import torch

    def with_moments(step):
        def run(self, *args, **kwargs):
            dtype = torch.float if self.fp32_optimizer_states else None
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state.get(p) or {}
                    for name in ("exp_avg", "exp_avg_sq"):
                        t = state.get(name)
                        if t is not None and t.numel() == 0 and p.numel():
                            t.data = torch.zeros_like(p.data, dtype=dtype or p.dtype)
            return step(self, *args, **kwargs)
        return run

    if _wrap(module.DeepSpeedCPUAdam, "step", with_moments):
        _say("CPUAdam: an emptied Adam moment is set back to its zeros before the step (host-memory route)")


PATCHES = {"op_ds.ops.op_builder.builder": patch_builder, "gpt_model": patch_gpt_model,
           "ratel_init": patch_ratel_init, "op_ds.ops.CPUAdam": patch_cpu_adam}


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch; anything else (get_source for tracebacks) is the loader's."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Finds a patched module through the other finders and wraps its loader."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def fail_on_queue_errors() -> None:
    """A queue item that cannot be sent ends the process (exit 70) rather than leaving a reader waiting."""
    import multiprocessing
    import multiprocessing.queues

    def on_error(error, item):
        traceback.print_exc()
        _say(f"a multiprocessing queue could not send a {type(item).__name__} ({type(error).__name__}: {error}); "
             "stopping, as its reader would wait for it forever")
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(70)

    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(on_error)


def install() -> None:
    ensure_distutils()
    fail_on_queue_errors()
    if not any(isinstance(f, PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportHook(PATCHES))
