"""The host AdamW of a tile with float32 masters in one pass over memory, for both layouts
(`engine.optimizer_kernel: compiled`; the kernel is host_adamw.cpp).

The eager update (adamw.adamw) is torch's fused AdamW, and with a split master (store.py,
docs/host-store.md) passes around it: the master joined into a float32 scratch, updated there and
split back. The update is bound by memory bandwidth, so here one loop reads each element's state
once and writes it once: a whole master reads the gradient, the master and both moments and
writes all but the gradient (28 bytes a parameter with a float32 gradient, torch's own); a split
one reads the gradient, the shadow, the low half and both moments and writes all but the gradient
(28 bytes, in five arrays). experiments/probes/adamw_rate.py times both against the eager update,
torch's own fused AdamW and the machine's memory bandwidth. The clipping scale, where there is
one, is applied in the same loop, not in a pass of its own.

The arithmetic is torch's fused AdamW on the CPU, operation for operation (host_adamw.cpp), so a
tile's master and moments are the eager update's to the bit, in either layout; the
elements past a call's last full vector of torch's width take torch's scalar formula, as there.
Which of its products and sums are fused multiply-adds differs between torch's builds and vector
widths, so a process finds them once, when it loads the kernel: the forms whose update of a probe
(a body of whole vectors, and calls shorter than one) is torch's fused AdamW's to the bit here.
Where no vector form is, the kernel is not used (`probe` says why); where no scalar form is (torch
2.11's AVX-512 build on the H200 host), the elements past a call's last full vector, fewer than a
vector, are updated by torch's fused AdamW itself.

The kernel is C++ (OpenMP, -O3 -march=native): a loop per vector form, vectorised by the compiler,
and where the CPU has AVX-512 BW and DQ a split master's halves joined and split in 16-bit lanes by
intrinsics. The machine's C++ compiler builds it into a shared library the first time a process asks
for it, kept in a per-user cache (MEGATRAIN_CACHE_DIR, else $XDG_CACHE_HOME/megatrain, else
~/.cache/megatrain), named by a hash of its source, its flags, torch's version and the CPU's (a
second process loads it and runs no compiler; the build takes about 3 s on the 2-core CPU machine,
7-12 s on the lent H200's host). It is called through
ctypes, which releases the GIL for the call: it runs on the optimizer worker while the main thread
launches the GPU's kernels. Without a C++ compiler `probe` says why, and the trainer refuses
`compiled` by name or, under `auto`, runs the eager update.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.config import OptimConfig
from megatrain.store import join, split

SOURCE = Path(__file__).with_name("host_adamw.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fPIC", "-shared"]


@dataclass(frozen=True)
class Build:
    """The kernel's library (None where it could not be built: `why`), whether this process
    compiled it (else it came from the cache) and the seconds it took to have it."""
    library: ctypes.CDLL | None
    why: str | None
    compiled: bool
    seconds: float
    path: Path
    form: int = 0  # the arithmetic's forms that are torch's here (host_adamw.cpp, set_forms)
    scalar_tail: bool = True  # a scalar form is torch's: the kernel takes a call's tail too


_build: Build | None = None
_lock = threading.Lock()


def cache_dir() -> Path:
    if root := os.environ.get("MEGATRAIN_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrain"


def _cpu_flags() -> str:
    """What the CPU's code may use (-march=native): its model and flags, from the kernel's list."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))  # each distinct line once (cores repeat them)


def library_path() -> Path:
    """Where this source, built with these flags for this torch and this CPU, is kept."""
    key = "\n".join([SOURCE.read_text(), " ".join(FLAGS), torch.__version__, platform.machine(), _cpu_flags()])
    return cache_dir() / "kernels" / f"host_adamw-{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"


def _compile(path: Path) -> str | None:
    """Build the library at `path` (atomically: processes building side by side each write their
    own file and rename it): None, or why not."""
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None or shutil.which(cxx) is None:
        return f"no C++ compiler found ({'CXX=' + cxx if cxx else 'c++, g++ and clang++ are not on PATH'})"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", temporary], capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            return f"{cxx} failed to build {SOURCE.name}: {lines[-1] if lines else done.returncode}"
        os.replace(temporary, path)
    except OSError as e:
        return f"{cxx} could not be run: {e}"
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return None


def build() -> Build:
    """The kernel, loaded from the cache or built there, once a process."""
    global _build
    with _lock:
        if _build is None:
            start = time.perf_counter()
            path = library_path()
            compiled, why, library = not path.is_file(), None, None
            if compiled:
                why = _compile(path)
            if why is None:
                try:
                    library = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime is the one linked
                    for fn, arrays in ((library.megatrain_adamw_whole, 4), (library.megatrain_adamw_split, 5)):
                        fn.restype = None  # (the arrays, length, body, 7 scalars, bf16 grad, threads, form)
                        fn.argtypes = [ctypes.c_void_p] * arrays + [ctypes.c_int64] * 2 + [ctypes.c_double] * 7 + [ctypes.c_int] * 3
                except OSError as e:
                    library, why = None, f"the built kernel {path} does not load: {e}"
            vector, scalar = (None, None) if library is None else _torch_forms(library)
            if library is not None and vector is None:
                library, why = None, (f"no form of the kernel's arithmetic gives torch {torch.__version__}'s fused AdamW's "
                                      f"numbers on this CPU ({torch.backends.cpu.get_cpu_capability()})")
            _build = Build(library, why, compiled, time.perf_counter() - start, path, (vector or 0) | (scalar or 0),
                           scalar is not None)
    return _build


# host_adamw.cpp's `form`: the vector second moment's three forms, the vector lerp's two and the
# vector step's two (the order: what torch's builds were seen to do first), then the scalar
# formula's likewise
VECTOR_FORMS = [moment | lerp << 2 | step << 6 for step in (0, 1) for lerp in (0, 1) for moment in (0, 1, 2)]
SCALAR_FORMS = [moment << 3 | lerp << 5 | step << 7 for step in (0, 1) for lerp in (0, 1) for moment in (0, 1, 2)]


def _torch_forms(library: ctypes.CDLL) -> tuple[int | None, int | None]:
    """The vector and the scalar forms whose update of a probe is torch's fused AdamW's to the bit
    (both lerp branches: beta1 0.9 and 0.3): the vector ones on calls of whole vectors, the scalar
    ones on calls shorter than a vector, which torch's scalar formula takes whole; None where no form is."""
    gen = torch.Generator().manual_seed(0)

    def piece(n: int) -> list[torch.Tensor]:  # master, gradient, exp_avg, exp_avg_sq
        return [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5]

    def run(state: list[torch.Tensor], beta1: float, form: int | None) -> list[torch.Tensor]:
        p, g, m, v = (t.clone() for t in state)
        n, lr, wd, eps, beta2 = p.numel(), 1e-3, 0.1, 1e-8, 0.999
        if form is None:
            torch._fused_adamw_([p], [g], [m], [v], [], [torch.full((), 3.0)], lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        else:
            library.megatrain_adamw_whole(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n,
                                          n - n % VECTOR, 3.0, lr, beta1, beta2, wd, eps, 1.0, 0, 1, form)
        return [t.view(torch.int32) for t in (p, m, v)]

    def first(forms: list[int], pieces: list[list[torch.Tensor]]) -> int | None:
        cases = [(state, beta1, run(state, beta1, None)) for state in pieces for beta1 in (0.9, 0.3)]
        return next((form for form in forms if all(
            all(map(torch.equal, run(state, beta1, form), want)) for state, beta1, want in cases)), None)

    return first(VECTOR_FORMS, [piece(64 * VECTOR)]), first(SCALAR_FORMS, [piece(VECTOR - 1) for _ in range(64)])


def probe() -> str | None:
    """Have the kernel (built, or from the cache): None if it works, else why not."""
    return build().why


def _vector_width() -> int:
    """Floats in a vector of torch's CPU kernels here (its fused AdamW's scalar tail is the rest)."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


VECTOR = _vector_width()


def _check(n: int, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        assert t is None or (t.device.type == "cpu" and t.is_contiguous() and t.numel() == n), (t.device, t.shape)


def update(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, lr: float,
           weight_decay: float, cfg: OptimConfig, grad_scale: float = 1.0, *, master: torch.Tensor | None = None,
           shadow: torch.Tensor | None = None, low: torch.Tensor | None = None) -> None:
    """AdamW update number `step` (1-based), as torch's fused AdamW's one call on these elements,
    of a whole float32 `master` or of a split one (`shadow` and `low`, the flags in `exp_avg_sq`:
    store.py), from `grad` (float32 or bf16) times `grad_scale`. All 1-D, of one length,
    contiguous, on the CPU."""
    built = build()
    if built.library is None:
        raise RuntimeError(f"the host AdamW kernel is not available: {built.why}")
    n = grad.numel()
    if not built.scalar_tail and n % VECTOR:
        body = n - n % VECTOR
        if body:
            update(grad[:body], exp_avg[:body], exp_avg_sq[:body], step, lr, weight_decay, cfg, grad_scale,
                   master=None if master is None else master[:body], shadow=None if shadow is None else shadow[:body],
                   low=None if low is None else low[:body])
        _torch_tail(grad[body:], exp_avg[body:], exp_avg_sq[body:], step, lr, weight_decay, cfg, grad_scale,
                    master=None if master is None else master[body:], shadow=None if shadow is None else shadow[body:],
                    low=None if low is None else low[body:])
        return
    library = built.library
    _check(n, grad, exp_avg, exp_avg_sq, master, shadow, low)
    assert exp_avg.dtype == exp_avg_sq.dtype == torch.float32 and grad.dtype in (torch.float32, torch.bfloat16)
    beta1, beta2 = cfg.betas
    scalars = (n, n - n % VECTOR, float(step), lr, beta1, beta2, weight_decay, cfg.eps, grad_scale,
               int(grad.dtype == torch.bfloat16), torch.get_num_threads(), built.form)
    if low is None:
        assert master is not None and master.dtype == torch.float32 and shadow is None
        library.megatrain_adamw_whole(master.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                      *scalars)
    else:
        assert master is None and shadow.dtype == torch.bfloat16 and low.dtype == torch.int16
        library.megatrain_adamw_split(shadow.data_ptr(), low.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                                      exp_avg_sq.data_ptr(), *scalars)


def _torch_tail(grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, lr: float,
                weight_decay: float, cfg: OptimConfig, grad_scale: float, *, master: torch.Tensor | None,
                shadow: torch.Tensor | None, low: torch.Tensor | None) -> None:
    """`update` of a call's last elements, fewer than a vector, by torch's fused AdamW (its scalar
    formula, which no form of the kernel gives here), as the eager update does them."""
    param = master if low is None else join(shadow, low, exp_avg_sq, torch.empty(grad.numel()), take=True)
    grad = grad.to(torch.float32, copy=True).mul_(grad_scale)
    beta1, beta2 = cfg.betas
    torch._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.full((), float(step))], lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)
    if low is not None:
        split(param, shadow, low, exp_avg_sq)
